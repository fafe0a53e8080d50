"""Every option of the table through every front end and every resume (issue 67, item 1).

    python -m tests.option_sweep --cases 500 --seed 0
    python -m tests.option_sweep --case momentum-split-v2-s7      # one case again
    python -m tests.option_sweep --count                          # how many cases exist

A case is one option of ``dmuon.options.table.OPTIONS``, one value of it (:func:`values_of`:
its default, a changed value, a bad one and a pool of edge values), one front end and a model
seed. Each case holds the front end to the reference, ``DMuon(..., option=value)``:

- ``kwargs``: the reference itself: it accepts what the table's check accepts, refuses the rest
  naming the option and ``DMuon``, and an accepted value is what its part's groups (or the
  whole optimizer) hold; ``foreach`` also on the owner exchange (below);
- ``split``, ``muon_group``, ``adamw_group``: the value in a param group dict (a group without
  ``use_muon``, split between the parts; a Muon group and an AdamW group): accepted or refused
  alike, refusals naming the option and the group, and each part the group reaches configured
  as the reference's (a split group steps bit for bit as the reference). A flag (``foreach``,
  ``fused``, ``capturable``) in a group is set against the optimizer's opposite: the group's
  own must win;
- ``titan02``: TorchTitan 0.2's ``[optimizer]`` field in a TOML file, at parse time; an
  accepted value gives DMuon the reference's configuration;
- ``titan03``: the checks TorchTitan 0.3's config runs on a group's ``optimizer_kwargs`` or
  the factory kwargs (``torchtitan_ext.titan03.options``; they import beside 0.2.2 too);
- ``resume_changed``, ``resume_missing``, ``resume_bad``, ``resume_elsewhere``: a state dict
  whose saved groups hold the value (changed from the saved run's), lack the key, hold a bad
  value, or hold the key under the other part (a whole-optimizer option: in a group). What the
  option's row says happens: refused naming the key (nothing loaded), or applied: the
  optimizer keeps its configuration, the change is logged, and the next step has the bits of
  the configured run loaded with the unedited state;
- ``resume_converted`` (an option whose row converts the state on resume: ``momentum_dtype``,
  ``adamw_state_dtype``): state dicts saved by runs that kept their state in each form (the
  parameter's dtype, bf16, int8: the value's own form too), each loaded into an optimizer
  given the value: every state it configures is held in the value's form (a
  vector's AdamW moments in its dtype) with the bits a fresh conversion of the saved state
  gives (read as the parameter's dtype, rounded once into the new form, by the documented
  formulas written out here: :func:`fresh_state`), the saved bits where the forms agree, the
  change and the conversion are logged, and the next step has the bits of the configured run
  loaded with that freshly converted state;
- ``capture``: the value set on the optimizer after a captured step's replay guard was made:
  the guard refuses it naming the option, but for ``lr`` and ``weight_decay``, whose numbers
  it copies into the tensors the graph reads.

The owner exchange: ``foreach`` through ``kwargs`` and ``split`` is also run on a two-rank
``Shard(0)`` model over a fake process group in this process (its collectives do nothing: the
values are not checked, only the form every rule is handed), and every rule must be handed
the group's form. The sweep runs in a process of its own (it makes that process group).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib
import inspect
import io
import itertools
import logging
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dmuon import DMuon
from dmuon.options.table import (BY_NAME, DEFAULTS, FLAG_KEYS, OPTIMIZER_OPTIONS, OPTIONS, OnResume, Scope,
                                 ADAMW_KEYS, MUON_KEYS)

# Each option's bad and changed values, from its row.
BAD = {o.name: o.bad for o in OPTIONS}
CHANGED = {o.name: o.changed for o in OPTIONS}

FRONTS = ("kwargs", "split", "muon_group", "adamw_group", "titan02", "titan03", "resume_changed", "resume_missing",
          "resume_bad", "resume_elsewhere", "resume_converted", "capture")
# Values every option is also tried with: wrong types, bounds, other options' values.
EDGES = (None, True, False, 0, 1, -1.0, 0.5, 2, 1e-3, "yes", "int8", (0.5, 0.5), float("nan"))
MODEL_SEEDS = 100
SWITCHED_FLAGS = ("foreach", "fused", "capturable")  # set against the optimizer's opposite in a group
DEVICE_NUMBERS = ("lr", "weight_decay")  # a number written between replays is copied in
# The forms a state is kept in, by an option whose row converts it on resume (OnResume.CONVERTED).
STATE_FORMS = (None, "bfloat16", "int8")


@dataclass(frozen=True)
class Case:
    option: str
    front: str
    value: int  # index into values_of(option)
    seed: int

    @property
    def id(self) -> str:
        return f"{self.option}-{self.front}-v{self.value}-s{self.seed}"


def values_of(name: str) -> list[Any]:
    """The values an option is tried with, in a fixed order: its default, a changed one, a bad
    one, then :data:`EDGES` (each once)."""
    seen, out = set(), []
    for value in (DEFAULTS[name], CHANGED.get(name, DEFAULTS[name]), BAD[name], *EDGES):
        if repr(value) not in seen:
            seen.add(repr(value))
            out.append(value)
    return out


def parts_of(name: str) -> tuple[str, ...]:
    """The parts (``muon``, ``adamw``, ``whole``) an option configures."""
    scope = BY_NAME[name].scope
    if scope is Scope.OPTIMIZER:
        return ("whole",)
    if name == "fused":
        return ("adamw",)
    return {Scope.MUON: ("muon",), Scope.ADAMW: ("adamw",)}.get(scope, ("muon", "adamw"))


def fronts_of(name: str) -> tuple[str, ...]:
    """The front ends an option has."""
    option, parts = BY_NAME[name], parts_of(name)
    fronts = ["kwargs", "capture"]
    if parts != ("whole",):
        fronts += ["split", "resume_changed", "resume_missing", "resume_bad"]
        fronts += [f"{part}_group" for part in parts]
    if option.scope in (Scope.MUON, Scope.ADAMW, Scope.OPTIMIZER):
        fronts.append("resume_elsewhere")
    if option.on_resume is OnResume.CONVERTED:
        fronts.append("resume_converted")
    if option.titan02 == name:
        fronts.append("titan02")
    if option.titan03 is not None and option.titan03 != "implementation":
        fronts.append("titan03")
    return tuple(f for f in FRONTS if f in fronts)


def all_cases() -> Iterator[Case]:
    for option in OPTIONS:
        for front in fronts_of(option.name):
            for value in range(len(values_of(option.name))):
                for seed in range(MODEL_SEEDS):
                    yield Case(option.name, front, value, seed)


def count() -> int:
    return sum(len(fronts_of(o.name)) * len(values_of(o.name)) * MODEL_SEEDS for o in OPTIONS)


def sample(n: int, seed: int) -> list[Case]:
    """``n`` cases drawn by ``seed``, in rounds over every (option, front end) pair in a drawn
    order, each case with a drawn model seed: the first round takes each option's changed
    value (accepted, not the default: what shows a value going astray), the second its bad
    value, the third its default, later rounds any value."""
    draw = random.Random(seed)
    pairs = [(o.name, f) for o in OPTIONS for f in fronts_of(o.name)]
    picked: list[Case] = []
    for round_ in itertools.count():
        if len(picked) >= n:
            return picked
        draw.shuffle(pairs)
        for option, front in pairs[: n - len(picked)]:
            value = (1, 2, 0)[round_] if round_ < 3 else draw.randrange(len(values_of(option)))
            picked.append(Case(option, front, value, draw.randrange(MODEL_SEEDS)))
    return picked


def parse(case_id: str) -> Case:
    try:
        head, value, seed = case_id.rsplit("-", 2)
        option, front = next((o, head[len(o) + 1:]) for o in sorted(BY_NAME, key=len, reverse=True)
                             if head.startswith(o + "-"))
        case = Case(option, front, int(value.removeprefix("v")), int(seed.removeprefix("s")))
    except (ValueError, StopIteration) as error:
        raise ValueError(f"not an option-sweep case id: {case_id!r}") from error
    if case.id != case_id or front not in fronts_of(option) or not 0 <= case.value < len(values_of(option)):
        raise ValueError(f"not an option-sweep case id: {case_id!r}")
    return case


# ------------------------------------------------------------------------- the model


class Net(nn.Module):
    """Two Muon matrices, an AdamW bias and an AdamW embedding matrix (``embed.weight``: the
    default routing's AdamW; the one AdamW parameter whose moments ``adamw_state_dtype`` keeps
    in its form), plain tensors, drawn from ``seed``."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.w1 = nn.Parameter(torch.randn(16, 8, generator=gen))
        self.w2 = nn.Parameter(torch.randn(8, 16, generator=gen))
        self.bias = nn.Parameter(torch.randn(8, generator=gen))
        self.embed = nn.ParameterDict({"weight": nn.Parameter(torch.randn(6, 12, generator=gen))})

    def muon(self) -> list[nn.Parameter]:
        return [self.w1, self.w2]


ADAMW_NAMES = ("bias", "embed.weight")  # Net's AdamW part


def grads(net: Net, step: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    for p in net.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 0.1


def run(optimizer: DMuon, net: Net, steps: range, seed: int) -> None:
    for step in steps:
        grads(net, step, seed)
        optimizer.step()


def same_bits(a: Net, b: Net) -> bool:
    return all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a.parameters(), b.parameters()))


def canon(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return float(value.item())
    if isinstance(value, (list, tuple)):
        return tuple(canon(v) for v in value)
    return value


def config_of(optimizer: DMuon) -> dict[str, dict[str, Any]]:
    """The effective configuration of each part: a group's options, its flags (its own, else
    the optimizer's), and the whole optimizer's options."""
    whole = {name: canon(getattr(optimizer, name)) for name in OPTIMIZER_OPTIONS if name != "telemetry"}
    whole.update(telemetry=optimizer.phases.telemetry.enabled,
                 **{flag: canon(getattr(optimizer, flag)) for flag in SWITCHED_FLAGS})
    out: dict[str, dict[str, Any]] = {"whole": whole}
    for group in optimizer.param_groups:
        part = "muon" if group["use_muon"] else "adamw"
        config = {key: canon(group[key]) for key in (MUON_KEYS if group["use_muon"] else ADAMW_KEYS)}
        for flag in FLAG_KEYS:
            if flag == "fused" and group["use_muon"]:
                continue
            own = group.get(flag, getattr(optimizer, flag, None))
            config[flag] = bool(own) if flag in ("maximize", "differentiable", "capturable") else canon(own)
        out[part] = config
    return out


# ------------------------------------------------------------------------- the front ends


class Refused(Exception):
    """A front end refused the value: its message."""


def _refusal(build: Callable[[], Any]) -> tuple[Any, str | None]:
    try:
        return build(), None
    except (ValueError, TypeError) as error:
        return None, str(error)


def _opposite(value: Any) -> bool:
    return not value


def build(case: Case, front: str, net: Net, value: Any) -> DMuon:
    """DMuon with ``value`` given through ``front`` (one of the constructor's front ends)."""
    option = BY_NAME[case.option]
    if front == "kwargs":
        return DMuon(list(net.named_parameters()), **{case.option: value})
    flag = case.option in SWITCHED_FLAGS
    base = {case.option: _opposite(value)} if flag and value is not None else {}
    if case.option == "fused" and base.get("fused"):
        base["foreach"] = None
    key = case.option if option.scope is not Scope.ADAMW else case.option  # the alias adamw_<x> in any group
    named = dict(net.named_parameters())
    muon = [(n, p) for n, p in named.items() if n not in ADAMW_NAMES]
    adamw = [(n, named[n]) for n in ADAMW_NAMES]
    if front == "split":
        return DMuon([{"params": list(named.items()), key: value}], **base)
    if front == "muon_group":
        return DMuon([{"params": muon, "use_muon": True, key: value}, {"params": adamw, "use_muon": False}], **base)
    if front == "adamw_group":
        return DMuon([{"params": muon, "use_muon": True}, {"params": adamw, "use_muon": False, key: value}], **base)
    raise ValueError(front)


def names_option(message: str, case: Case, where: str) -> bool:
    option = BY_NAME[case.option]
    names = {case.option, option.key, *(option.titan02 or "").replace(",", " ").split()}
    return where in message and any(name in message for name in names)


# ------------------------------------------------------------------------- one case


def check(case: Case) -> list[str]:
    """The case's failures (empty: it passed); ``["skip: ..."]`` where its front end is absent."""
    value = values_of(case.option)[case.value]
    front = case.front
    if front == "resume_converted":
        return check_converted(case, value)
    if front.startswith("resume"):
        return check_resume(case, value)
    if front == "capture":
        return check_capture(case, value)
    net = Net(case.seed)
    reference, refused = _refusal(lambda: build(case, "kwargs", net, value))
    if front == "kwargs":
        if refused is not None:
            return [] if names_option(refused, case, "DMuon") else [f"refusal names neither option nor DMuon: {refused}"]
        failures = _reaches(case, value, reference)
        if case.option == "foreach":
            failures += owner_exchange_forms(case, value, "kwargs")
        return failures
    if front == "titan02":
        return check_titan02(case, value)
    if front == "titan03":
        return check_titan03(case, value, refused)
    mine, mine_refused = _refusal(lambda: build(case, front, Net(case.seed), value))
    where = "param group"
    if (refused is None) != (mine_refused is None):
        return [f"kwargs {'refuses' if refused else 'accepts'} ({refused}), {front} "
                f"{'refuses' if mine_refused else 'accepts'} ({mine_refused})"]
    if mine_refused is not None:
        return [] if names_option(mine_refused, case, where) else [f"refusal names neither option nor group: "
                                                                     f"{mine_refused}"]
    failures = []
    want, got = config_of(reference), config_of(mine)
    for part in ("muon", "adamw") if front == "split" else parts_of(case.option):  # split: no part may differ
        if front == "split" or front == f"{part}_group":
            if want[part] != got[part]:
                diff = {k: (want[part][k], got[part].get(k)) for k in want[part] if want[part][k] != got[part].get(k)}
                failures.append(f"{part} part configured unlike DMuon({case.option}=...): (kwargs, {front}) {diff}")
    if front == "split" and not failures:
        a, b = Net(case.seed), Net(case.seed)
        run(DMuon(list(a.named_parameters()), **{case.option: value}), a, range(1), case.seed)
        run(build(case, front, b, value), b, range(1), case.seed)
        if not same_bits(a, b):
            failures.append("a split group steps with other bits than DMuon(option=value)")
        if case.option == "foreach":
            failures += owner_exchange_forms(case, value, "split")
    return failures


def _reaches(case: Case, value: Any, optimizer: DMuon) -> list[str]:
    """An accepted keyword is what its part holds (canonical forms compared as the check makes them)."""
    option = BY_NAME[case.option]
    checked = option.check(copy.deepcopy(value), option.key, "sweep")
    config = config_of(optimizer)
    failures = []
    for part in parts_of(case.option):
        key = case.option if part == "whole" else option.key
        held = config[part][key]
        if case.option == "adamw_lr" and value is None or case.option == "adamw_weight_decay" and value is None:
            continue  # None: the shared option's value
        if key in ("maximize", "differentiable"):
            continue
        if canon(held) != canon(checked) and not (held is None and checked is None):
            failures.append(f"{part} holds {held!r}, the option was {value!r}")
    return failures


# ------------------------------------------------------------------------- TorchTitan


def _parse_toml(fields: str) -> Any:
    from torchtitan.config import ConfigManager

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.toml"
        path.write_text('[job]\ncustom_config_module = "torchtitan_ext"\n[experimental]\n'
                        'custom_import = "torchtitan_ext.titan02.job"\n[optimizer]\nname = "DMuon"\n' + fields)
        with contextlib.redirect_stderr(io.StringIO()):
            return ConfigManager().parse_args(["--job.config_file", str(path)])


def check_titan02(case: Case, value: Any) -> list[str]:
    """The ``[optimizer]`` field ``value`` as TOML spells it (TOML has no null: ``from_toml``'s
    spellings are DMuon's values), against DMuon given TorchTitan's other fields' values and
    this one's meaning."""
    from torchtitan_ext import versions

    if versions.torchtitan_line() != "0.2":
        return ["skip: TorchTitan 0.2 is not installed"]
    from torchtitan_ext.titan02.kwargs import dmuon_kwargs, from_toml, toml_value

    written = toml_value(case.option, value)
    text = _toml(written)
    if text is None:
        return ["skip: no TOML spelling"]
    meaning = from_toml(case.option, copy.deepcopy(written))
    net = Net(case.seed)
    others = {k: v for k, v in dmuon_kwargs(_parse_toml("").optimizer, net.parameters()).items() if k != case.option}
    reference, refused = _refusal(lambda: DMuon(list(net.named_parameters()), **others, **{case.option: meaning}))
    try:
        config = _parse_toml(f"{case.option} = {text}\n")
        mine_refused = None
    except (ValueError, TypeError, SystemExit) as error:
        mine_refused = str(error)
    if (refused is None) != (mine_refused is None):
        return [f"kwargs {'refuses' if refused else 'accepts'} ({refused}), the TOML "
                f"{'refuses' if mine_refused else 'accepts'} ({mine_refused})"]
    if mine_refused is not None:
        return [] if names_option(mine_refused, case, "[optimizer]") else [f"refusal unnamed: {mine_refused}"]
    net = Net(case.seed)
    made = DMuon(list(net.named_parameters()), **dmuon_kwargs(config.optimizer, net.parameters()))
    if config_of(made) != config_of(reference):
        return [f"the TOML configures DMuon otherwise: {config_of(made)} vs {config_of(reference)}"]
    return []


def _toml(value: Any) -> str | None:
    if value is None or isinstance(value, float) and value != value:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (list, tuple)):
        parts = [_toml(v) for v in value]
        return None if any(p is None for p in parts) else f"[{', '.join(parts)}]"
    return None


def check_titan03(case: Case, value: Any, refused: str | None) -> list[str]:
    try:  # 0.3's checks read no 0.3-only name: they run (and are held to DMuon) beside 0.2.2 too
        from torchtitan_ext.titan03 import options as titan03
    except ImportError:
        return ["skip: torchtitan_ext.titan03 does not import here"]
    option = BY_NAME[case.option]
    where = "optimizer"
    try:
        if option.scope is Scope.OPTIMIZER:
            titan03.check_factory_options({case.option: value}, where)
        else:
            titan03.check_group_options({case.option: value}, where)
        mine_refused = None
    except (ValueError, TypeError) as error:
        mine_refused = str(error)
    if (refused is None) != (mine_refused is None):
        return [f"kwargs {'refuses' if refused else 'accepts'} ({refused}), 0.3's config "
                f"{'refuses' if mine_refused else 'accepts'} ({mine_refused})"]
    if mine_refused is not None and not names_option(mine_refused, case, where):
        return [f"refusal unnamed: {mine_refused}"]
    return []


# ------------------------------------------------------------------------- resume


def _saved_key(case: Case) -> str:
    option = BY_NAME[case.option]
    return case.option if option.scope is Scope.OPTIMIZER else option.key


def _edit(case: Case, saved: dict[str, Any], value: Any) -> bool:
    """Put the case's edit into ``saved``'s groups; False where there is nothing to edit."""
    key, parts = _saved_key(case), parts_of(case.option)
    edited = False
    for group in saved["param_groups"]:
        part = "muon" if group["use_muon"] else "adamw"
        mine = part in parts
        if case.front == "resume_elsewhere":
            if not mine:
                group[key] = value
                edited = True
        elif mine and case.front == "resume_missing":
            if key in group:
                del group[key]
                edited = True
        elif mine:
            group[key] = value if case.front == "resume_changed" else BAD[case.option]
            edited = True
    return edited


def expected_resume(case: Case) -> str:
    """``refused`` or ``applied``: what the option's row says a resume does with the edit."""
    option = BY_NAME[case.option]
    if case.front == "resume_elsewhere":
        return "applied"  # a key not of that group's kind: dropped, the configuration kept
    if case.front == "resume_missing":
        return "refused" if option.key in MUON_KEYS + ADAMW_KEYS else "applied"
    return "refused" if option.on_resume is OnResume.REFUSED else "applied"


def _logged_load(optimizer: DMuon, state: dict[str, Any]) -> tuple[str | None, str]:
    """``optimizer.load_state_dict(state)``: its refusal (None: it loaded) and dmuon's log lines."""
    logs = io.StringIO()
    handler = logging.StreamHandler(logs)
    logging.getLogger("dmuon").addHandler(handler)
    logging.getLogger("dmuon").setLevel(logging.INFO)
    try:
        optimizer.load_state_dict(state)
        return None, logs.getvalue()
    except (ValueError, KeyError, TypeError) as error:
        return str(error), logs.getvalue()
    finally:
        logging.getLogger("dmuon").removeHandler(handler)


def check_resume(case: Case, value: Any) -> list[str]:
    if case.front == "resume_changed":
        value = CHANGED.get(case.option, value)
    saved_net = Net(case.seed)
    saved_run = DMuon(list(saved_net.named_parameters()))
    run(saved_run, saved_net, range(2), case.seed)
    state = saved_run.state_dict()
    edited = copy.deepcopy(state)
    if not _edit(case, edited, value):
        return ["skip: nothing to edit"]
    loaded_net, configured_net = copy.deepcopy(saved_net), copy.deepcopy(saved_net)
    loaded = DMuon(list(loaded_net.named_parameters()))
    configured = DMuon(list(configured_net.named_parameters()))
    configured.load_state_dict(copy.deepcopy(state))
    before = config_of(loaded)
    want = expected_resume(case)
    got, logged = _logged_load(loaded, edited)
    key = _saved_key(case)
    if want == "refused":
        if got is None:
            return [f"the row says a resume refuses this, it loaded (config {config_of(loaded)})"]
        return [] if key in got else [f"refused without naming {key}: {got}"]
    if got is not None:
        return [f"the row says a resume applies this, it was refused: {got}"]
    failures = []
    if config_of(loaded) != before:
        failures.append(f"the load changed the configuration: {before} -> {config_of(loaded)}")
    if f"changed on resume: {key} " not in logged:
        failures.append(f"the change of {key} was not logged: {logged!r}")
    run(loaded, loaded_net, range(2, 3), case.seed)
    run(configured, configured_net, range(2, 3), case.seed)
    if not same_bits(loaded_net, configured_net):
        failures.append("the next step's bits are not the configured run's")
    return failures


# ------------------------------------------------------------------------- resume, converted

# The keys of each kept state in each form (docs/optimizer.md, "Momentum dtype", "AdamW state
# dtype"): (float buffer, int8 values, their fp32 scales, whether int8 keeps the square root).
KEPT_KEYS = {"momentum_dtype": [("momentum_buffer", "momentum_int8", "momentum_scales", False)],
             "adamw_state_dtype": [("exp_avg", "exp_avg_int8", "exp_avg_scales", False),
                                   ("exp_avg_sq", "exp_avg_sq_root_int8", "exp_avg_sq_root_scales", True)]}
INT8_BLOCK, INT8_MIN_ROW = 128, 5  # elements a scale; the narrowest row kept in int8 (else bf16)


def form_of(option: str, param: torch.Tensor, wanted: str | None) -> str | None:
    """The form a parameter's state is kept in under ``wanted`` (documented): the AdamW part
    keeps a vector's moments in its dtype; int8 rows narrower than 5 elements keep bf16."""
    if option == "adamw_state_dtype" and param.ndim < 2:
        return None
    width = param.shape[-1] if param.ndim <= 3 else param[0].numel()
    return "bfloat16" if wanted == "int8" and width < INT8_MIN_ROW else wanted


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1) if x.ndim > 3 else x.reshape(-1, x.shape[-1]) if x.ndim > 1 else x.reshape(1, -1)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented int8 form, written out: per block of 128 elements of a row, scale =
    max|x| / 127 in fp32, q = round(x / scale) half to even in [-127, 127], 0 where scale is 0."""
    rows = _rows(x.float())
    values, scales = torch.empty(rows.shape, dtype=torch.int8), []
    for start in range(0, rows.shape[-1], INT8_BLOCK):
        block = rows[:, start:start + INT8_BLOCK]
        scale = block.abs().amax(dim=-1, keepdim=True) / torch.tensor(127.0)
        q = torch.where(scale > 0, torch.round(block / torch.where(scale > 0, scale, 1.0)), 0.0)
        values[:, start:start + INT8_BLOCK] = q.clamp(-127, 127).to(torch.int8)
        scales.append(scale)
    scales_shape = (*x.shape[:-1], -1) if 1 < x.ndim <= 3 else (rows.shape[0], -1) if x.ndim > 3 else (-1,)
    return values.reshape(x.shape), torch.cat(scales, dim=-1).reshape(scales_shape)


def dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q * scale, each value by its block's scale, in fp32."""
    rows, blocks = _rows(values).float(), _rows(scales) if values.ndim > 1 else scales.reshape(1, -1)
    out = torch.cat([rows[:, start:start + INT8_BLOCK] * blocks[:, j:j + 1]
                     for j, start in enumerate(range(0, rows.shape[-1], INT8_BLOCK))], dim=-1)
    return out.reshape(values.shape)


def fresh_state(entry: dict[str, Any], keys: tuple[str, str, str, bool], held: str | None, target: str | None,
                dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One kept state of a saved ``entry`` (held in the form ``held``) in the form ``target``:
    the saved tensors where the forms agree, else read as ``dtype`` (int8: q * scale, squared
    where it keeps the root) and rounded once into ``target`` (int8: of the square root)."""
    buffer, int8, scales, root = keys
    if held == target:
        return {k: entry[k] for k in keys[:3] if k in entry}
    if held == "int8":
        working = dequantize(entry[int8], entry[scales]).to(dtype)
        working = working * working if root else working
    else:
        working = entry[buffer].to(dtype)
    if target is None:
        return {buffer: working}
    if target == "bfloat16":
        return {buffer: working.to(torch.bfloat16)}
    values, block_scales = quantize(working.sqrt() if root else working)
    return {int8: values, scales: block_scales}


def _tensor_differ(a: Any, b: Any) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return not (a == b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return True
    return not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def check_converted(case: Case, value: Any) -> list[str]:
    """The ``resume_converted`` front (module docstring)."""
    option = BY_NAME[case.option]
    try:
        target = option.check(copy.deepcopy(value), option.key, "sweep")
    except (ValueError, TypeError):
        return ["skip: the value is not a form (its refusal: the kwargs front)"]
    return [f"saved in {held}: {failure}" for held in STATE_FORMS
            for failure in _converted_from(case, value, target, held)]


def _converted_from(case: Case, value: Any, target: str | None, held_form: str | None) -> list[str]:
    """:func:`check_converted` from a state saved in ``held_form``."""
    option = BY_NAME[case.option]
    saved_net = Net(case.seed)
    saved_run = DMuon(list(saved_net.named_parameters()), **{case.option: held_form})
    run(saved_run, saved_net, range(2), case.seed)
    saved = saved_run.state_dict()
    names = [n for n, _ in saved_net.named_parameters()]
    index = {n: i for g in saved["param_groups"] for n, i in zip(g["param_names"], g["params"])}
    part = "muon" if option.scope is Scope.MUON else "adamw"
    mine = [n for n in names if (n in ADAMW_NAMES) == (part == "adamw")]
    params = dict(saved_net.named_parameters())
    fresh = copy.deepcopy(saved)
    converted = False
    for name in mine:
        entry, param = fresh["state"][index[name]], params[name]
        held, wanted = form_of(case.option, param, held_form), form_of(case.option, param, target)
        converted |= held != wanted
        for keys in KEPT_KEYS[case.option]:
            new = fresh_state(entry, keys, held, wanted, param.dtype)
            for key in keys[:3]:
                entry.pop(key, None)
            entry.update(new)
    for group in fresh["param_groups"]:
        if ("muon" if group["use_muon"] else "adamw") == part:
            group[option.key] = target
    loaded_net, configured_net = copy.deepcopy(saved_net), copy.deepcopy(saved_net)
    loaded = DMuon(list(loaded_net.named_parameters()), **{case.option: value})
    configured = DMuon(list(configured_net.named_parameters()), **{case.option: value})
    refused, text = _logged_load(loaded, copy.deepcopy(saved))
    if refused is not None:
        return [f"the row says a resume converts the state, it was refused: {refused}"]
    configured.load_state_dict(copy.deepcopy(fresh))
    failures = []
    by_name = {n: p for n, p in loaded_net.named_parameters()}
    for name in names:
        got, want = loaded.state.get(by_name[name], {}), fresh["state"][index[name]]
        wrong = sorted(k for k in set(got) | set(want) if k not in got or k not in want
                       or _tensor_differ(got[k], want[k]))
        if wrong:
            forms = {k: f"{str(got[k].dtype)[6:]}{list(got[k].shape)}" for k in got if isinstance(got[k], torch.Tensor)}
            failures.append(f"{name}: state {wrong} not the fresh conversion's from {held_form} to {target} "
                            f"(held {forms})")
    if held_form != target and f"changed on resume: {option.key} " not in text:
        failures.append(f"the change of {option.key} was not logged: {text!r}")
    if converted and "converted on resume from" not in text:
        failures.append(f"the conversion was not logged: {text!r}")
    run(loaded, loaded_net, range(2, 3), case.seed)
    run(configured, configured_net, range(2, 3), case.seed)
    if not same_bits(loaded_net, configured_net):
        failures.append("the next step's bits are not those of the run loaded with the freshly converted state")
    return failures


# ------------------------------------------------------------------------- capture


def check_capture(case: Case, value: Any) -> list[str]:
    from dmuon.capture.replay_guard import ReplayGuard

    net = Net(case.seed)
    if _refusal(lambda: DMuon(list(net.named_parameters()), **{case.option: value}))[1] is not None:
        value = CHANGED.get(case.option, value)  # a value DMuon takes
    optimizer = DMuon(list(net.named_parameters()), capturable=True)
    run(optimizer, net, range(1), case.seed)
    guard = ReplayGuard(optimizer)
    option = BY_NAME[case.option]
    current = getattr(optimizer, case.option, None) if option.scope in (Scope.OPTIMIZER, Scope.FLAG) else None
    groups = [g for g in optimizer.param_groups if ("muon" if g["use_muon"] else "adamw") in parts_of(case.option)]
    if option.scope is Scope.OPTIMIZER or (option.scope is Scope.FLAG and case.option in SWITCHED_FLAGS):
        if canon(current) == canon(value) or case.option == "telemetry":
            return ["skip: the value is the captured one"] if case.option != "telemetry" else \
                ["skip: telemetry is refused at capture (capture_problems)"]
        setattr(optimizer, case.option, value)
    else:
        if all(canon(g.get(option.key)) == canon(value) for g in groups):
            return ["skip: the value is the captured one"]
        for group in groups:
            group[option.key] = value
    try:
        guard.check()
        refused = None
    except RuntimeError as error:
        refused = str(error)
    if option.key in DEVICE_NUMBERS and isinstance(value, (int, float)) and not isinstance(value, bool):
        if refused is not None:
            return [f"a number written to {option.key} was refused: {refused}"]
        held = [g[option.key] for g in groups]
        if not all(isinstance(t, torch.Tensor) and float(t) == float(value) for t in held):
            return [f"{case.option} = {value!r} was not copied into the tensors the graph reads: {held}"]
        return []
    if refused is None:
        return [f"{case.option} changed after the capture and the replay guard let it pass"]
    return [] if (case.option in refused or option.key in refused) else [f"refusal unnamed: {refused}"]


# ------------------------------------------------------------------------- the owner exchange's forms


_FAKE_MESH: list[Any] = []


def _fake_mesh() -> Any:
    """A two-rank CPU mesh over a fake process group (this process is rank 0; collectives do nothing)."""
    if not _FAKE_MESH:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from dmuon.torch_compat import fake_store

        if not dist.is_initialized():
            dist.init_process_group("fake", store=fake_store(), rank=0, world_size=2)
        _FAKE_MESH.append(init_device_mesh("cpu", (2,)))
    return _FAKE_MESH[0]


@contextlib.contextmanager
def forms_handed() -> Iterator[list[bool]]:
    """Record the ``foreach`` every function and class of dmuon's numerics and exchange that
    takes one is handed, wherever it is called from."""
    seen: list[bool] = []
    patched: list[tuple[Any, str, Any]] = []
    targets = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith(("dmuon.numerics", "dmuon.exchange")):
            continue
        for attr, obj in vars(module).items():
            if getattr(obj, "__module__", None) == name and callable(obj):
                fn = obj.__init__ if inspect.isclass(obj) else obj
                try:
                    if "foreach" in inspect.signature(fn).parameters:
                        targets[id(obj)] = obj
                except (TypeError, ValueError):
                    continue

    def wrap(fn: Callable) -> Callable:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind_partial(*args, **kwargs)
            if isinstance(bound.arguments.get("foreach"), bool):
                seen.append(bound.arguments["foreach"])
            return fn(*args, **kwargs)
        return recorded

    for obj in targets.values():
        if inspect.isclass(obj):
            patched.append((obj, "__init__", obj.__init__))
            obj.__init__ = wrap(obj.__init__)
    wrapped = {id(obj): wrap(obj) for obj in targets.values() if not inspect.isclass(obj)}
    for name, module in list(sys.modules.items()):
        if name.startswith("dmuon."):
            for attr, obj in list(vars(module).items()):
                if id(obj) in wrapped:
                    patched.append((module, attr, obj))
                    setattr(module, attr, wrapped[id(obj)])
    try:
        yield seen
    finally:
        for owner, attr, obj in reversed(patched):
            setattr(owner, attr, obj)


def owner_exchange_forms(case: Case, value: Any, front: str) -> list[str]:
    """``foreach`` given through ``front`` on a two-rank ``Shard(0)`` model (the owner exchange,
    bf16 momentum read block by block, a parameter without a grad): every rule is handed the
    group's form, against the optimizer's opposite."""
    from torch.distributed.tensor import DTensor, Shard

    from dmuon.numerics.update_rules import resolve_foreach

    mesh = _fake_mesh()
    gen = torch.Generator().manual_seed(case.seed)

    def param(*shape: int) -> nn.Parameter:
        return nn.Parameter(DTensor.from_local(torch.randn(shape, generator=gen), mesh, [Shard(0)]))

    params = [("w1", param(8, 8)), ("w2", param(4, 16)), ("bias", param(4))]
    if front == "kwargs":
        optimizer = DMuon(params, foreach=value, momentum_dtype="bfloat16")
    else:
        optimizer = DMuon([{"params": params, "foreach": value}], foreach=_opposite(value), momentum_dtype="bfloat16")
    want = resolve_foreach(value, torch.device("cpu"))
    for step in range(2):
        for name, p in params[:2]:
            if name != "w2" or step == 0:
                p.grad = DTensor.from_local(torch.randn(p.to_local().shape, generator=gen), mesh, [Shard(0)])
            else:
                p.grad = None
        with forms_handed() as seen:
            optimizer.step()
    wrong = sorted(set(seen) - {want})
    return [] if not wrong else [f"on the owner exchange a rule was handed foreach={wrong[0]}, the groups' is {want}"]


# ------------------------------------------------------------------------- the driver


@dataclass
class Outcome:
    case: Case
    failures: list[str]
    seconds: float

    @property
    def skipped(self) -> bool:
        return bool(self.failures) and all(f.startswith("skip:") for f in self.failures)


def run_case(case: Case) -> Outcome:
    start = time.perf_counter()
    try:
        with torch.random.fork_rng(), contextlib.redirect_stdout(io.StringIO()):
            failures = check(case)
    except Exception:  # noqa: BLE001 - a harness or product crash is the case's failure
        failures = ["crashed: " + traceback.format_exc(limit=6)]
    return Outcome(case, failures, time.perf_counter() - start)


def sweep(cases: list[Case], log: Callable[[str], None] = print) -> list[Outcome]:
    outcomes = []
    start = time.perf_counter()
    for k, case in enumerate(cases, 1):
        outcome = run_case(case)
        outcomes.append(outcome)
        if outcome.failures and not outcome.skipped:
            log(f"FAILED {case.id}: {'; '.join(outcome.failures)[:600]}")
        if k % 100 == 0:
            log(f"... {k} of {len(cases)} cases, {time.perf_counter() - start:.0f} s")
    return outcomes


def summary(outcomes: list[Outcome], seconds: float) -> str:
    failed = [o for o in outcomes if o.failures and not o.skipped]
    skipped = [o for o in outcomes if o.skipped]
    by_front: dict[str, list[int]] = {}
    for o in outcomes:
        row = by_front.setdefault(o.case.front, [0, 0, 0])
        row[0 if not o.failures else 1 if o.skipped else 2] += 1
    lines = [f"option sweep: {len(outcomes)} cases, {len(outcomes) - len(failed) - len(skipped)} passed, "
             f"{len(skipped)} skipped, {len(failed)} failed, {seconds:.0f} s"]
    lines += [f"  {front:<17} passed {row[0]:>4}  skipped {row[1]:>4}  failed {row[2]:>4}"
              for front, row in by_front.items()]
    lines += [f"FAILED {o.case.id}: {'; '.join(o.failures)[:400]}" for o in failed]
    lines.append(f"{len(outcomes) - len(failed) - len(skipped)} passed, {len(failed)} failed, {len(skipped)} skipped")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.option_sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--case", action="append", default=[], help="run this case id (repeatable)")
    parser.add_argument("--count", action="store_true", help="print how many cases exist")
    args = parser.parse_args(argv)
    if args.count:
        print(count())
        return 0
    torch.set_num_threads(1)
    logging.getLogger("dmuon").propagate = False
    cases = [parse(c) for c in args.case] or sample(args.cases, args.seed)
    start = time.perf_counter()
    outcomes = sweep(cases, log=lambda text: print(text, flush=True))
    print(summary(outcomes, time.perf_counter() - start))
    return 1 if any(o.failures and not o.skipped for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
