"""torch.optim's implementation flags on DMuon: ``foreach``, ``fused`` and ``capturable``
(each an optimizer keyword and a group key, torch's names and meanings), the flags DMuon has
no path for (``maximize``, ``differentiable``), and the checks that refuse, when a group is
made, what torch would refuse at its first step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from dmuon.torch_compat import capturable_devices, fused_adamw_devices, local_of

# torch.optim's implementation flags, which torch keeps per group: a group that sets one
# steps with it (None: torch's default for the device), a group without it with the
# optimizer's. ``fused`` is the AdamW part's alone: Muon has no fused kernel. torch's
# other per-group flags name paths DMuon has none for: off (False, None) is taken and kept
# on the group that sets it, on is refused (:func:`check_no_path_flags`).
# ``capturable`` is kept on every group: its hyperparameters live on the device
# (``dmuon.numerics.device_scalars``).
NO_PATH_KEYS = ("maximize", "differentiable")
IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", *NO_PATH_KEYS)


def check_foreach(value: Any, where: str = "DMuon") -> bool | None:
    """``foreach``: True, False, or None (torch's default for the parameters' device)."""
    if not (value is None or isinstance(value, bool)):
        raise ValueError(f"{where}: foreach must be True, False or None (torch's default for the device), "
                         f"got {value!r}")
    return value


def check_fused(value: Any, where: str = "DMuon") -> bool | None:
    """``fused``: True (the AdamW part steps with torch's fused AdamW kernel), False, or
    None (not fused: torch.optim.AdamW's default)."""
    if not (value is None or isinstance(value, bool)):
        raise ValueError(f"{where}: fused must be True, False or None (not fused, torch.optim.AdamW's default), "
                         f"got {value!r}; fused=True steps the AdamW part with torch's fused AdamW")
    return value


# torch.optim's flags for paths DMuon does not have, with the reason: each is taken as
# False or None (off) and refused when on, naming it and saying what to do instead.
NO_PATH_FLAGS = {
    "maximize": "it only minimizes, as torch.optim.Muon does: minimize the negated objective instead",
    "differentiable": "its step runs under torch.no_grad, as torch.optim.Muon's does: no gradient flows through it",
}


def check_no_path_flags(flags: Mapping[str, Any], where: str = "DMuon") -> None:
    """``maximize``, ``differentiable`` (those in ``flags``): False or None."""
    for name, value in flags.items():
        if value is True:
            raise ValueError(f"{where}: {name}=True has no path in DMuon ({NO_PATH_FLAGS[name]}); leave {name} "
                             "unset, False or None")
        if value is not None and value is not False:
            raise ValueError(f"{where}: {name} must be False or None (DMuon has no {name} path), got {value!r}")


def check_capturable(value: Any, where: str = "DMuon") -> bool:
    """``capturable``: True (the group's ``lr`` and ``weight_decay`` live on the device, for a
    step captured in a CUDA graph), False or None (off)."""
    if not (value is None or isinstance(value, bool)):
        raise ValueError(f"{where}: capturable must be True, False or None (off), got {value!r}")
    return bool(value)


def check_capturable_adamw(named: Iterable[tuple[str, torch.Tensor]], foreach: bool | None, fused: bool | None,
                           where: str) -> None:
    """A capturable AdamW group whose parameters are on a device torch's ``capturable`` AdamW
    refuses (the CPU) steps with a Tensor lr on the paths torch allows without it: per tensor
    or fused, not ``foreach=True``."""
    if not foreach or fused:
        return
    for name, param in named:
        device = local_of(param).device.type
        if device not in capturable_devices():
            raise ValueError(f"{where}: capturable=True with foreach=True has no AdamW path for {name!r} on "
                             f"{device} (torch's capturable AdamW runs on {capturable_devices()}; elsewhere torch "
                             "takes a Tensor lr only per tensor or fused): set foreach=False or None, or fused=True")


def check_tensor_lr_path(lr: Any, foreach: bool | None, fused: bool | None, where: str) -> None:
    """torch.optim.AdamW refuses a Tensor ``lr`` with ``foreach=True`` when it is built (its
    list path takes a Tensor lr only with ``capturable``); DMuon refuses the same for a group
    without ``capturable``, with torch's words, before any step can half-run."""
    if isinstance(lr, torch.Tensor) and foreach and not fused:
        raise ValueError(f"{where}: lr as a Tensor is not supported for capturable=False and foreach=True "
                         "(torch.optim.AdamW's rule): give the AdamW part a float lr (adamw_lr), or set "
                         "foreach=False or None, or fused=True")


def takes_fused_adamw(param: torch.Tensor) -> bool:
    """Whether torch's fused AdamW steps ``param``: floating point, on a device it has the
    kernel for (``dmuon.torch_compat.fused_adamw_devices``: CUDA and CPU among them)."""
    return param.is_floating_point() and param.device.type in fused_adamw_devices()


def check_fused_params(named: Iterable[tuple[str, torch.Tensor]], where: str) -> None:
    """``fused=True`` for these parameters: torch.optim.AdamW finds an unsupported one at its
    first step, DMuon when the group is made."""
    for name, param in named:
        if not takes_fused_adamw(param):
            raise ValueError(f"{where}: fused=True needs floating-point parameters on one of "
                             f"{fused_adamw_devices()} (torch's fused AdamW), but {name!r} is {param.dtype} on "
                             f"{param.device.type}; set fused=False or None for its group (or the optimizer)")


def check_no_fused_muon(options: dict[str, Any], use_muon: bool | None, where: str) -> None:
    """``fused=True`` where it has no path: a Muon group (torch's fused kernel is AdamW's)."""
    if use_muon and options.get("fused"):
        raise ValueError(f"{where}: fused=True has no path in a Muon group (torch's fused kernel is AdamW's; Muon's "
                         "elementwise rules run as list ops with foreach=True): set fused on an AdamW group or on a "
                         "group without use_muon (its AdamW part)")


def own_flags(members: list[tuple[str, torch.Tensor]], use_muon: bool, options: dict[str, Any], lr: Any,
               implementation: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The group's own ``foreach`` / ``fused`` / ``capturable``, checked. An AdamW group is
    checked with the flags it will step with, as torch.optim.AdamW checks them (a Tensor lr
    with foreach; fused for a device or dtype torch has no fused kernel for), but here, at
    construction. A Muon group keeps no ``fused``: a split group's Muon part leaves it to the
    AdamW part (``check_no_fused_muon`` refuses it in a Muon group)."""
    own = {key: options[key] for key in IMPLEMENTATION_KEYS if key in options}
    check_foreach(own.get("foreach"), where)
    check_fused(own.get("fused"), where)
    if "capturable" in own:
        own["capturable"] = check_capturable(own["capturable"], where)
    if use_muon:
        own.pop("fused", None)
        return own
    flags = {**implementation, **own}
    if flags.get("capturable"):
        check_capturable_adamw(members, flags.get("foreach"), flags.get("fused"), where)
    else:
        check_tensor_lr_path(lr, flags.get("foreach"), flags.get("fused"), where)
    if flags.get("fused"):
        check_fused_params(members, where)
    return own


def check_optimizer_flags(flags: Mapping[str, Any], adamw_lr: Any) -> tuple[bool | None, bool | None, bool]:
    """The constructor's flags, checked: ``foreach``, ``fused``, ``capturable`` returned; the
    no-path ones refused when on; a Tensor AdamW lr with ``foreach`` as torch refuses it
    (under ``capturable``, per AdamW group, where its device is known)."""
    check_no_path_flags({key: flags[key] for key in NO_PATH_KEYS})
    foreach, fused, capturable = check_foreach(flags["foreach"]), check_fused(flags["fused"]), \
        check_capturable(flags["capturable"])
    if not capturable:
        check_tensor_lr_path(adamw_lr, foreach, fused, "DMuon (AdamW part)")
    return foreach, fused, capturable
