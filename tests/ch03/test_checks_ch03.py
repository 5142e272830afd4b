"""Chapter 03's checks: right answers written another way pass. memlab's own answers pass and the labs'
stubs are todo: tests/course/test_course.py; wrong answers: tests/course/mutants/ch03.py."""
from __future__ import annotations

import torch

from memlab.course.grading import check


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
