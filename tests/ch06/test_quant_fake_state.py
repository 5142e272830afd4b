"""memlab.quant.linear4bit.fake_nf4_state: on fake tensors, Linear4bit.quantize_ makes its buffers at their sizes
without the quantization's arithmetic; each buffer equals, in shape, dtype, strides, storage offset and storage
bytes, what the arithmetic (quantize_nf4, double_quantize) leaves, over drawn weight shapes and block sizes."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from memlab.quant import Linear4bit
from memlab.quant.blockwise import NF4_BLOCKSIZES, double_quantize, quantize_nf4
from memlab.quant.linear4bit import fake_nf4_state


def meta(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.dtype, t.stride(), t.storage_offset(), t.untyped_storage().nbytes(), t.device)


@settings(max_examples=60, deadline=None)
@given(out=st.integers(1, 300), inp=st.integers(1, 300), blocksize=st.sampled_from(NF4_BLOCKSIZES),
       double=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_fake_state_equals_the_arithmetics_buffers(out, inp, blocksize, double, dtype):
    with FakeTensorMode():
        w = torch.empty(out, inp, dtype=dtype)
        packed, absmax = quantize_nf4(w, blocksize)
        want = [packed] + (list(double_quantize(absmax)) if double else [absmax])
        got_packed, scales = fake_nf4_state(w, blocksize, double)
        got = [got_packed, *scales]
    assert all(isinstance(t, FakeTensor) for t in got)
    assert [meta(t) for t in got] == [meta(t) for t in want]


@pytest.mark.parametrize("double", [True, False])
def test_a_fake_linear4bit_holds_the_same_buffers_as_a_real_one(double):
    # the layer built from a fake nn.Linear (the estimator's QLoRA) and from a real one: the same buffer names, in the
    # same order, with the same metadata (a fake tensor's storage on the fake device; a real one's on the CPU)
    real = Linear4bit.from_linear(torch.nn.Linear(96, 40), torch.bfloat16, 64, double)
    with FakeTensorMode():
        fake = Linear4bit.from_linear(torch.nn.Linear(96, 40), torch.bfloat16, 64, double)
    r, f = dict(real.named_buffers()), dict(fake.named_buffers())
    assert list(r) == list(f) and all(isinstance(t, FakeTensor) for t in f.values())
    assert [meta(t)[:5] for t in r.values()] == [meta(t)[:5] for t in f.values()]
    assert (real.absmax is None) == (fake.absmax is None) == double
