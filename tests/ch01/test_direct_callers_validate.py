"""The estimator's inner functions refuse bad values by name for callers that skip the API's schema
(memlab.plan, a learner's code): a float ZeRO stage (``1.0 in (0, 1, 2, 3)`` is true), an infinite or
beyond-float LoRA alpha (``math.isfinite(10**400)`` raises OverflowError)."""
from __future__ import annotations

import pytest

from memlab.estimate.adapters import adapter_spec
from memlab.estimate.sharding import check_zero


@pytest.mark.parametrize("stage", [1.0, 3.0, True, "1", None])
def test_check_zero_refuses_a_stage_that_is_not_an_int(stage):
    with pytest.raises(ValueError, match=r"^zero_stage=.* is invalid; allowed: 0 \(data parallel\)"):
        check_zero(2, stage, "adamw")


@pytest.mark.parametrize("alpha", [float("inf"), float("nan"), 10**400, -1, 0])
def test_adapter_spec_refuses_an_alpha_that_is_not_a_finite_positive_number(alpha):
    with pytest.raises(ValueError, match=r"^lora_alpha=.* is invalid; allowed: a number > 0"):
        adapter_spec("lora", lora_alpha=alpha)


def test_the_good_values_pass():
    check_zero(2, 1, "adamw")
    assert adapter_spec("lora", lora_alpha=10**6).alpha == 10**6
