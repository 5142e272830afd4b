"""Chapter 06's shared test helper: the bytes a dequantize allocates when traced on fake tensors."""
from __future__ import annotations

import pytest


@pytest.fixture
def fake_dequantize_bytes():
    """``f(packed, absmax, n, dtype, blocksize)``: the peak rise a MemoryTracker sees when memlab's
    ``dequantize_nf4`` runs on fake copies of ``packed`` and ``absmax`` under a FakeTensorMode (what memlab.estimate
    traces), checking the fake result's shape and dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memlab import quant as Q
    from memlab.profiler import MemoryTracker

    def measure(packed, absmax, n, dtype, blocksize):
        with FakeTensorMode() as mode:
            fp, fa = mode.from_tensor(packed), mode.from_tensor(absmax)
            with MemoryTracker() as tracker:
                start = tracker.current_bytes
                fake = Q.dequantize_nf4(fp, fa, (n,), dtype, blocksize)
                assert fake.shape == (n,) and fake.dtype == dtype
                del fake
        return tracker.peak_bytes - start

    return measure
