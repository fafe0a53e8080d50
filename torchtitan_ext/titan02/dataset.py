"""The 0.2.x validator's part of the embedded corpus (the datasets themselves are
registered by ``torchtitan_ext.datasets``, shared with 0.3.x)."""

from __future__ import annotations

from typing import Any


def rewind_validation_before_each_run(validator: Any) -> Any:
    """Make every validation pass score the same held-out batches.

    TorchTitan's validator keeps one data iterator for the whole job, so with
    ``[validation] steps > 0`` each pass reads the *next* batches and the curve
    mixes progress with sampling noise. We snapshot the validation dataloader's
    state once and restore it before every pass. The training data is untouched.
    """
    loader = getattr(validator, "validation_dataloader", None)
    if loader is None or not hasattr(loader, "state_dict"):
        return validator
    initial_state = loader.state_dict()
    original_validate = validator.validate

    def validate(*args: Any, **kwargs: Any) -> Any:
        loader.load_state_dict(initial_state)
        return original_validate(*args, **kwargs)

    validator.validate = validate
    return validator
