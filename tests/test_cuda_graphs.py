"""``dmuon.capture.cuda_graphs.CapturedStep`` on the CPU: what it refuses to capture, each with the
reason; with stand-ins for torch.cuda's streams and graphs, its host logic (issues 42, 50, 67):
the replay guard (the tensors, the groups' and the whole optimizer's options), numbers
written to ``lr`` or ``weight_decay``, a load reaching what the graph reads, the
replays' counts read by ``check()``, the side stream joined after a failed warm-up step.
The capture and replay themselves need a GPU: tests/test_cuda.py."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch

from dmuon import AttentionHeads, DMuon
from dmuon.capture.cuda_graphs import CapturedStep, capture_problems
from dmuon.options.table import OPTIMIZER_OPTIONS

pytestmark = pytest.mark.unit


def _params() -> list[tuple[str, torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(0)
    return [("wq", torch.nn.Parameter(torch.randn(8, 8, generator=gen))),
            ("wk", torch.nn.Parameter(torch.randn(8, 8, generator=gen))),
            ("bias", torch.nn.Parameter(torch.randn(8, generator=gen)))]


def test_a_capturable_optimizer_on_the_cpu_is_refused_for_its_parameters_place():
    optimizer = DMuon(_params(), capturable=True)
    assert [p.split(":")[0] for p in capture_problems(optimizer)] == ["parameters not on a CUDA device (FSDP2's "
                                                                      "CPU offload steps on the host)"]
    with pytest.raises(ValueError, match=r"^dmuon.capture.cuda_graphs: this DMuon's step cannot be captured: parameters "
                                         r"not on a CUDA device .*\['wq', 'wk', 'bias'\]"):
        CapturedStep(optimizer)


def test_every_option_that_cannot_be_captured_is_named_with_what_to_do():
    params = _params()
    optimizer = DMuon(params, telemetry=True, qk_clip_threshold=50.0)
    optimizer.clip_attention("attn", params[0][1], params[1][1], AttentionHeads(2, 2, 4))
    problems = capture_problems(optimizer)
    assert [p.split(":")[0] for p in problems] == [
        "capturable=False", "telemetry=True", "QK-clip", "parameters not on a CUDA device (FSDP2's CPU offload "
                                                         "steps on the host)"]
    assert "construct DMuon with capturable=True" in problems[0]


class _Stream:
    """A stand-in for a CUDA stream: records which streams it was made to wait for."""

    def __init__(self) -> None:
        self.waited_for: list[_Stream] = []

    def wait_stream(self, other: _Stream) -> None:
        self.waited_for.append(other)

    def synchronize(self) -> None:
        pass


class _Graph:
    """A stand-in for ``torch.cuda.CUDAGraph``: a replay runs ``on_replay`` (what the test
    says the recorded kernels do), never the step's host code."""

    def __init__(self) -> None:
        self.replays = 0
        self.on_replay = lambda: None

    def replay(self) -> None:
        self.replays += 1
        self.on_replay()

    def reset(self) -> None:
        pass


class _Capture:
    """A stand-in for ``torch.cuda.graph``: the "captured" step runs eagerly on the CPU (its
    host code is what these tests check); the hyperparameters it finds are recorded."""

    def __init__(self, optimizer: DMuon) -> None:
        self.optimizer, self.lr_seen, self.options = optimizer, [], []

    def __call__(self, graph: _Graph, **options) -> contextlib.AbstractContextManager:
        self.lr_seen.append([group["lr"] for group in self.optimizer.param_groups])
        self.options.append(options)
        return contextlib.nullcontext()


def _on_cpu(optimizer: DMuon, monkeypatch, warmup_steps: int = 1) -> tuple[CapturedStep, _Stream, _Capture]:
    """A CapturedStep whose CUDA stream and graph calls are stand-ins, so its host logic runs
    on the CPU: the warm-up steps run eagerly, the capture runs the step once, replays run
    nothing of the step's host code."""
    main, capture = _Stream(), _Capture(optimizer)
    monkeypatch.setattr("dmuon.capture.cuda_graphs.capture_problems", lambda optimizer: [])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: main)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    return CapturedStep(optimizer, warmup_steps=warmup_steps), main, capture


def test_a_capture_checks_only_its_own_threads_cuda_calls_and_takes_the_pool_it_is_given(monkeypatch):
    # Another thread's CUDA call (a pin-memory thread, a profiler) must not fail the capture,
    # and several optimizers' graphs share one pool (issue 59, items 2 and 4).
    params = _with_grads(_params())
    optimizer = DMuon(params, capturable=True)
    shared = object()
    monkeypatch.setattr("dmuon.capture.cuda_graphs.capture_problems", lambda optimizer: [])
    captured, _, capture = _on_cpu(optimizer, monkeypatch)
    captured = CapturedStep(optimizer, warmup_steps=1, pool=shared)
    assert captured.pool is shared  # before the capture: the pool it was given
    captured.step()  # warm-up
    captured.step()  # capture
    assert capture.options == [{"pool": shared, "capture_error_mode": "thread_local"}]


def test_a_capture_on_another_device_than_the_parameters_is_refused_naming_both():
    from dmuon.capture.cuda_graphs import device_problem

    assert device_problem(torch.device("cuda", 3), 3) is None
    assert device_problem(torch.device("cpu"), 0) is None
    problem = device_problem(torch.device("cuda", 1), 0)
    assert "cuda:1" in problem and "cuda:0" in problem and "torch.cuda.set_device(1)" in problem


def test_a_step_whose_current_device_is_not_the_parameters_raises_before_capturing(monkeypatch):
    params = _with_grads(_params())
    captured, _, capture = _on_cpu(DMuon(params, capturable=True), monkeypatch)
    monkeypatch.setattr("dmuon.capture.cuda_graphs.device_problem", lambda device, current: "wrong device")
    with pytest.raises(RuntimeError, match="dmuon.capture.cuda_graphs: wrong device"):
        captured.step()
    assert capture.lr_seen == []


def _with_grads(params, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    for _, p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return params


def _replaying(monkeypatch, **options):
    """A capturable DMuon with every grad, its CapturedStep warmed up and captured."""
    params = _with_grads(_params())
    optimizer = DMuon(params, capturable=True, **options)
    captured, main, capture = _on_cpu(optimizer, monkeypatch)
    captured.step()  # the warm-up step, eager
    captured.step()  # the capture, then the first replay
    assert captured.graph is not None and captured.graph.replays == 1
    return optimizer, params, captured


def test_a_parameter_without_a_grad_is_refused_before_any_step_naming_it(monkeypatch):
    params = _params()
    captured, _, _ = _on_cpu(DMuon(params, capturable=True), monkeypatch)
    params[0][1].grad = torch.zeros(8, 8)
    with pytest.raises(ValueError, match=r"no grad for \['wk', 'bias'\].*zero_grad\(set_to_none=False\)"):
        captured.step()


@pytest.mark.parametrize("change, what", [
    (lambda opt, params: setattr(params[0][1], "grad", torch.zeros(8, 8)), "the grad of 'wq'"),
    # The same grad object on new storage: an identity check alone would replay on the old.
    (lambda opt, params: params[1][1].grad.set_(torch.zeros(8, 8)), "the grad of 'wk'"),
    (lambda opt, params: opt.param_groups[0].__setitem__("lr", torch.tensor(0.1, dtype=torch.float64)),
     "lr of param group 0"),
    (lambda opt, params: opt.state[params[0][1]].__setitem__("momentum_buffer", torch.zeros(8, 8)),
     "the state 'momentum_buffer' of 'wq'"),
    (lambda opt, params: opt.param_groups[0].__setitem__("momentum", 0.5), r"the option\(s\) \['momentum'\]"),
])
def test_a_replay_after_a_change_the_graph_cannot_see_is_refused_naming_it(change, what, monkeypatch):
    optimizer, params, captured = _replaying(monkeypatch)
    change(optimizer, params)
    with pytest.raises(RuntimeError, match=what):
        captured.step()
    assert captured.graph.replays == 1  # refused before the replay


# A legal value other than the captured optimizer's (capturable=True, the rest the defaults),
# for each whole-optimizer option: a new option of the table fails below until it has one.
WHOLE_CHANGED = {"comm": "redistribute", "max_batch_numel": 1 << 20, "split_replicas": True, "ns_dtype": "float32",
                 "link_gbps": 100.0, "replica_link_gbps": 50.0, "telemetry": True, "skip_nonfinite": True,
                 "foreach": True, "fused": True, "capturable": False}


def _set_whole_option(optimizer: DMuon, name: str, value) -> None:
    if name == "telemetry":
        optimizer.phases.telemetry.enabled = value
    else:
        setattr(optimizer, name, value)


@pytest.mark.parametrize("name", [*OPTIMIZER_OPTIONS, "foreach", "fused", "capturable"])
def test_a_whole_optimizer_option_changed_after_the_capture_is_refused_naming_it(name, monkeypatch):
    optimizer, _, captured = _replaying(monkeypatch)
    _set_whole_option(optimizer, name, WHOLE_CHANGED[name])
    with pytest.raises(RuntimeError, match=rf"the optimizer's option\(s\) \['{name}'\] changed since the capture.*"
                                           r"call release\(\) and step\(\) again"):
        captured.step()
    assert captured.graph.replays == 1  # refused before the replay


def test_skip_nonfinite_turned_on_after_the_capture_is_refused_rather_than_a_nan_applied(monkeypatch):
    optimizer, params, captured = _replaying(monkeypatch)  # captured without skip_nonfinite: it applies a NaN
    before = [p.detach().clone() for _, p in params]
    optimizer.skip_nonfinite = True
    params[0][1].grad[0, 0] = float("nan")  # in place: the grad the graph reads
    with pytest.raises(RuntimeError, match=r"\['skip_nonfinite'\] changed since the capture"):
        captured.step()
    assert captured.graph.replays == 1
    assert all(torch.equal(p, b) for (_, p), b in zip(params, before))


def test_the_guard_holds_a_replaced_grad_so_its_memory_is_never_handed_to_another_tensor(monkeypatch):
    _, params, captured = _replaying(monkeypatch)
    old = weakref.ref(params[0][1].grad)
    params[0][1].grad = None  # zero_grad(set_to_none=True): the graph still reads the old grad's memory
    gc.collect()
    assert old() is not None
    params[0][1].grad = torch.zeros(8, 8)
    with pytest.raises(RuntimeError, match="the grad of 'wq' was replaced since the capture.*set_to_none=False"):
        captured.step()


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # its steps ran before it
def test_a_scheduled_lr_filled_in_place_is_no_change(monkeypatch):
    optimizer, _, captured = _replaying(monkeypatch)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    scheduler.step()
    captured.step()
    assert captured.graph.replays == 2


def test_a_number_written_to_lr_before_the_capture_is_on_the_device_when_it_starts(monkeypatch):
    params = _with_grads(_params())
    optimizer = DMuon(params, capturable=True)
    captured, _, capture = _on_cpu(optimizer, monkeypatch)
    captured.step()
    optimizer.param_groups[0]["lr"] = 0.01  # a scheduler that assigns numbers
    captured.step()
    (lrs,) = capture.lr_seen
    assert isinstance(lrs[0], torch.Tensor) and lrs[0].dtype == torch.float64 and lrs[0].item() == 0.01


def test_a_number_written_to_lr_between_replays_is_copied_into_the_tensor_the_graph_reads(monkeypatch):
    optimizer, _, captured = _replaying(monkeypatch)
    held = optimizer.param_groups[0]["lr"]
    optimizer.param_groups[0]["lr"] = 0.005
    captured.step()
    assert optimizer.param_groups[0]["lr"] is held and held.item() == 0.005
    assert captured.graph.replays == 2


def test_an_int_written_to_weight_decay_between_replays_is_copied_into_the_tensor_the_graph_reads(monkeypatch):
    optimizer, _, captured = _replaying(monkeypatch, weight_decay=0.1)
    held = optimizer.param_groups[0]["weight_decay"]
    optimizer.param_groups[0]["weight_decay"] = 0  # an int, as a schedule may write it
    captured.step()
    assert optimizer.param_groups[0]["weight_decay"] is held and held.item() == 0.0
    assert captured.graph.replays == 2


def test_load_state_dict_puts_the_loaded_state_into_the_tensors_the_graph_reads(monkeypatch):
    optimizer, params, captured = _replaying(monkeypatch)
    read = {key: value for key, value in optimizer.state[params[0][1]].items()}
    other = DMuon(_with_grads(_params(), seed=7), capturable=True)
    other.step()
    saved = other.state_dict()
    optimizer.load_state_dict(saved)
    for key, tensor in optimizer.state[params[0][1]].items():
        assert tensor is read[key], key
        assert torch.equal(tensor, saved["state"][0][key]), key
    captured.step()  # the guard finds every tensor it holds
    assert captured.graph.replays == 2


def test_a_warm_up_step_that_raises_still_joins_the_side_stream(monkeypatch):
    optimizer = DMuon(_with_grads(_params()), capturable=True)
    captured, main, _ = _on_cpu(optimizer, monkeypatch)

    def raising() -> None:
        raise ValueError("a step that raises")

    monkeypatch.setattr(optimizer, "step", raising)
    with pytest.raises(ValueError, match="a step that raises"):
        captured.step()
    assert len(main.waited_for) == 1  # the caller's stream waits for the side stream's kernels


# What a replay's recorded status kernels add to the tally: a plain step, a skipped one (a
# non-finite grad under skip_nonfinite) and one with an error (a rank's problem), as the
# two counts of a status without DTensor parameters: [ranks with a problem, non-finite].
CLEAN, SKIPPED, ERROR = [0, 0], [0, 1], [1, 0]


def _replays_of(statuses, monkeypatch):
    """A captured skip_nonfinite step whose next replays find ``statuses`` in turn."""
    optimizer, _, captured = _replaying(monkeypatch, skip_nonfinite=True)
    found = iter(statuses)
    captured.graph.on_replay = lambda: captured._tally.add_(torch.tensor(next(found), dtype=torch.int32))
    return optimizer, captured


def test_a_skip_in_any_replay_is_counted_once_however_often_check_is_called(monkeypatch):
    optimizer, captured = _replays_of([SKIPPED, CLEAN, SKIPPED, CLEAN], monkeypatch)
    for _ in range(4):
        captured.step()
    captured.check()
    captured.check()
    assert optimizer.skipped_steps == 2


def test_the_first_replayed_error_is_raised_once_by_check(monkeypatch):
    optimizer, captured = _replays_of([CLEAN, ERROR, SKIPPED], monkeypatch)
    for _ in range(3):
        captured.step()
    with pytest.raises(ValueError, match="1 rank\\(s\\) found an invalid gradient"):
        captured.check()
    captured.check()  # read once
    assert optimizer.skipped_steps == 1


@pytest.mark.parametrize("warmup", [0, 1.5])
def test_warmup_steps_must_be_a_positive_int(warmup, monkeypatch):
    monkeypatch.setattr("dmuon.capture.cuda_graphs.capture_problems", lambda optimizer: [])
    with pytest.raises(ValueError, match="warmup_steps must be an int >= 1"):
        CapturedStep(DMuon(_params(), capturable=True), warmup_steps=warmup)


def test_a_capture_refused_for_its_device_starts_no_replay_tally(monkeypatch):
    # The refusal comes before the tally begins: an eager step after it (the user calls
    # set_device and steps again) must count its status as an eager step.
    optimizer, _, captured = _replaying(monkeypatch)
    captured.release()
    monkeypatch.setattr("dmuon.capture.cuda_graphs.device_problem", lambda device, current: "wrong device")
    captured.eager_steps = captured.warmup_steps  # the next step captures
    with pytest.raises(RuntimeError, match="wrong device"):
        captured.step()
    with pytest.raises(AssertionError, match="end_tally without start_tally"):
        optimizer.phases.grad_status.end_tally()
