"""The optimizer's state and its life across steps, saves and copies: the momentum in the
form its group asks for, what a masked step takes back, and what loading, a resume with
changed options and pickling do.

May import: the layers, ``dmuon.options`` and ``dmuon.torch_compat``; never the step or the
optimizer.

- ``kept_state``: Muon's momentum in its group's ``momentum_dtype``;
- ``rollback``: a step's host changes, taken back when the step is masked;
- ``loading``: what ``DMuon.load_state_dict`` changes in torch's;
- ``resume_contract``: the group options a resume applies, and those it refuses;
- ``optimizer_hooks``: the torch hooks a DMuon carries (attached again on a copy);
- ``pickling``: how a DMuon pickles and deep-copies (its configuration, not its plan).
"""
