"""The step's masks (``dmuon.exchange.status_masks``) exist only after the step's one wait:
a mask read before it is a mistake in the phases' order and raises, naming the wait, instead
of waiting on its own. One process, no collective (a rank alone)."""

from __future__ import annotations

import pytest
import torch

from dmuon.exchange.status_masks import StatusMasks, StepMask

pytestmark = pytest.mark.unit


def alone(mask: StepMask = StepMask.STANDS) -> StatusMasks:
    """The status of a step no other rank takes part in."""
    return StatusMasks(None, None, None, [], mask, mask is StepMask.MASKED, torch.device("cpu"), [])


def test_the_step_mask_read_before_the_wait_raises_naming_the_wait():
    with pytest.raises(RuntimeError, match="before the step's wait"):
        alone().step_ok


def test_a_parameter_mask_read_before_the_wait_raises_naming_the_wait():
    with pytest.raises(RuntimeError, match="before the step's wait"):
        alone()[torch.zeros(1)]


@pytest.mark.parametrize(("mask", "applies"), [(StepMask.STANDS, True), (StepMask.MASKED, False)])
def test_after_the_wait_the_step_mask_says_whether_the_step_applies(mask, applies):
    status = alone(mask)
    status.wait()
    assert status.step_ok.item() is applies
