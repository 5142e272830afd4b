"""Chapter 03's checks pass on memlab's own answers; a stub is todo (wrong answers: tests/course/mutants/ch03.py)."""
from __future__ import annotations

import pytest
import torch

from memlab.course.grading import check, get_exercise, load_chapter

load_chapter("03")

IDS = ["03.underflow_fraction", "03.update_scale", "03.unscale_grads", "03.loss_scaler", "03.master_step",
       "03.predict_update_peak"]


@pytest.mark.parametrize("exercise", IDS)
def test_reference_passes(exercise):
    r = check(exercise, get_exercise(exercise).reference(), quiet=True)
    assert r.status == "pass", r.message


# Plausible wrong answers live in tests/course/mutants/ch03.py (tests/course/test_mutants.py).


@pytest.mark.parametrize("exercise", IDS)
def test_stub_is_todo(exercise):
    def stub(*a, **k):
        raise NotImplementedError(f"exercise {exercise}: replace this line with your code")

    assert check(exercise, stub, quiet=True).status == "todo"


def test_update_scale_with_python_floats_passes():
    """The right rule written with Python floats (one rounding to float32 by fill_) is a right answer."""
    def python_floats(scale, tracker, found_inf, growth, backoff, interval):
        if found_inf.item():
            scale.fill_(scale.item() * backoff)
            tracker.fill_(0)
            return
        t = tracker.item() + 1
        if t == interval:
            new = torch.tensor(scale.item() * growth, dtype=torch.float32)
            if torch.isfinite(new):
                scale.copy_(new)
            t = 0
        tracker.fill_(t)

    assert check("03.update_scale", python_floats, quiet=True).status == "pass"


def test_predict_update_peak_accepts_a_prediction_within_tolerance():
    """The check grades on relative error: 0.5% off memlab's model passes, as a prediction should."""
    from memlab import amp

    def close(model, recipe):
        return 1.005 * amp.update_peak_bytes(model, recipe)

    assert check("03.predict_update_peak", close, quiet=True).status == "pass"


def test_update_peak_counts_16_bit_buffers():
    """MasterWeights casts the model, float buffers too: the prediction follows (issue 24)."""
    from memlab import amp
    from memlab.course.checks.ch03 import _NormsAndTable

    for recipe in amp.UPDATE_RECIPES:
        torch.manual_seed(0)
        predicted = amp.update_peak_bytes(_NormsAndTable(), recipe)
        torch.manual_seed(0)
        measured = amp.measure_update_peak(_NormsAndTable(), recipe)
        assert abs(predicted / measured - 1) < 0.005, (recipe, predicted, measured)
