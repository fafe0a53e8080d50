"""Writes tests/data/dmuon_before_layers.pkl: a DMuon pickled by the code before dmuon's
modules moved into layer folders (commit b5258ec), after two steps on plain tensors, with
its parameters, the grads of a third step and the parameters that step gave. tests/test_pickles_from_before.py loads it
with today's code. Run once, from the repository root, on that commit:
``python tests/data/make_pickle_before_layers.py``."""

import pickle

import torch

from dmuon import DMuon

torch.manual_seed(0)
named = [("layers.0.weight", torch.randn(8, 6)), ("embed.weight", torch.randn(5, 4)), ("norm.weight", torch.randn(4))]
params = [torch.nn.Parameter(t) for _, t in named]
opt = DMuon([(n, p) for (n, _), p in zip(named, params)], lr=0.02, weight_decay=0.1, adamw_lr=1e-3)
for _ in range(2):
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
grads = [torch.randn_like(p) for p in params]
payload = pickle.dumps({"optimizer": opt, "params": params, "grads": grads, "state_dict": opt.state_dict()})
# The third step, taken by a copy: what today's code must give from the pickle, bit for bit.
copy = pickle.loads(payload)
for p, g in zip(copy["params"], grads):
    p.grad = g.clone()
copy["optimizer"].step()
with open("tests/data/dmuon_before_layers.pkl", "wb") as f:
    pickle.dump({"optimizer": opt, "params": params, "grads": grads, "state_dict": opt.state_dict(),
                 "after_third_step": [p.detach().clone() for p in copy["params"]]}, f)
