"""NF4 dequantize piece by piece (issue 42), on the torch path (forced here; the C++ path that CPU inputs with a
float32 absmax take by default: tests/ch06/test_nf4_native.py): bit-identical to the whole-weight table lookup it
replaced and to the codebook definition, for every dtype, block size, odd count and piece boundary; allocating only
the output and two piece-sized buffers (the CPU allocator's own events); and a fake-tensor trace allocating what the
real call does."""
from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memlab import quant as Q
from memlab.quant import blockwise as B

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


@pytest.fixture(autouse=True)
def _torch_path():
    # every test here is about the torch path's pieces; the default path is restored after each
    assert B.load_nf4_kernel("torch") == B.NF4_TORCH_NAME
    yield
    B.load_nf4_kernel()


@contextlib.contextmanager
def _budget(k: int):
    # the piece buffers' byte budget set to ``k`` (small ones: many pieces on small weights)
    old = B.NF4_DEQUANT_BUFFER_BYTES
    B.NF4_DEQUANT_BUFFER_BYTES = k
    try:
        yield
    finally:
        B.NF4_DEQUANT_BUFFER_BYTES = old


def _previous(packed: torch.Tensor, absmax: torch.Tensor, n: int, dtype: torch.dtype, blocksize: int) -> torch.Tensor:
    """The dequantize this replaced (memlab before issue 42's pieces), kept here on its own: a 256 x 2 table of
    each byte's float32 (high, low) values from the codebook, gathered for the whole weight, the full blocks scaled
    by one broadcast multiply, the partial block by its absmax, cast once."""
    code = Q.nf4_codebook()
    b = torch.arange(256)
    pairs = torch.stack([code[b >> 4], code[b & 15]], 1)
    values = pairs.index_select(0, packed.reshape(-1).view(torch.uint8).long()).reshape(-1)[:n]
    full = n - n % blocksize
    am = absmax.float()
    out = (values[:full].view(-1, blocksize) * am[: full // blocksize].unsqueeze(1)).reshape(-1)
    if full < n:
        out = torch.cat([out, values[full:] * am[full // blocksize]])
    return out.to(dtype)


def _definition(packed: torch.Tensor, absmax: torch.Tensor, n: int, dtype: torch.dtype, blocksize: int) -> torch.Tensor:
    # value i = codebook[code i] * absmax of block i // blocksize, in float32, rounded once to dtype
    codes = Q.unpack_nibbles(packed, n)
    return (Q.nf4_codebook()[codes] * absmax.float().repeat_interleave(blocksize)[:n]).to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # equal to the bit (a -0.0 is not a 0.0)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(_BITS[a.dtype]), b.view(_BITS[b.dtype]))


def _case(n: int, blocksize: int, extra: int, seed: int, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, ((n + 1) // 2 + extra,), generator=g, dtype=torch.uint8)
    absmax = torch.rand(-(-n // blocksize), generator=g)
    absmax = {"unit": absmax, "tiny": absmax * 1e-39, "huge": absmax * 3e38, "mixed": absmax * 10.0 ** torch.randint(
        -40, 38, absmax.shape, generator=g).float()}[scale]
    absmax[torch.rand(absmax.shape, generator=g) < 0.1] = 0.0  # all-zero blocks store 0.0
    return packed, absmax


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 3000), blocksize=st.sampled_from([64, 128, 256, 32, 1, 2, 3, 7, 33, 100, 4096]),
       dtype=st.sampled_from(DTYPES), budget=st.sampled_from([1, 12, 100, 384, 600, 1000, 3 << 19]),
       extra=st.integers(0, 2), seed=st.integers(0, 2**31 - 1), scale=st.sampled_from(["unit", "tiny", "huge", "mixed"]))
def test_pieces_bit_identical_to_the_previous_lookup_and_the_definition(n, blocksize, dtype, budget, extra, seed, scale):
    packed, absmax = _case(n, blocksize, extra, seed, scale)
    with _budget(budget):
        got = Q.dequantize_nf4(packed, absmax, (n,), dtype, blocksize)
    assert _same_bits(got, _previous(packed, absmax, n, dtype, blocksize))
    assert _same_bits(got, _definition(packed, absmax, n, dtype, blocksize))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,blocksize", [((1024, 1024), 64), ((300, 257), 128), ((4097, 65), 256), ((513, 1), 64),
                                             ((3, 5, 7), 32)], ids=str)
def test_real_weights_at_the_default_piece_size(shape, blocksize, dtype):
    # quantized weights, several pieces (1024 x 1024: two at float32, four else), partial last blocks, odd counts
    w = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)
    packed, absmax = Q.quantize_nf4(w, blocksize)
    n = w.numel()
    got = Q.dequantize_nf4(packed, absmax, shape, dtype, blocksize)
    assert got.shape == shape
    assert _same_bits(got.reshape(-1), _previous(packed, absmax, n, dtype, blocksize))
    assert _same_bits(got.reshape(-1), _definition(packed, absmax, n, dtype, blocksize))


def _expected_bytes(n: int, dtype: torch.dtype, blocksize: int) -> int:
    """The output, one piece's int32 indices (4 B a packed byte) and, unless a float32 output with an even count
    takes the gather itself, one piece's float32 values (8 B a packed byte); pieces of whole blocks and whole bytes,
    equal but for the last, as few as keep the buffers within the budget (a piece is never below one block). A
    weight in one piece through the value buffer holds at most indices + values, then values + output (the
    whole-weight lookup's peak before the pieces: never more)."""
    direct = dtype == torch.float32 and n % 2 == 0
    per_byte = 4 if direct else 12
    unit = blocksize if blocksize % 2 == 0 else 2 * blocksize
    most = unit * max(1, 2 * (B.NF4_DEQUANT_BUFFER_BYTES // per_byte) // unit)
    step = n if n <= most else -(-n // (-(-n // most) * unit)) * unit
    piece = (step + 1) // 2
    assert per_byte * piece <= max(B.NF4_DEQUANT_BUFFER_BYTES, per_byte * (unit // 2 + 1))
    output = n * torch.empty(0, dtype=dtype).element_size()
    if step == n and not direct:  # one piece through the value buffer: indices freed before the output comes
        return 8 * piece + max(4 * piece, output)
    return output + per_byte * piece


CASES = [(1 << 20, torch.bfloat16, 64, 3 << 19), (1 << 20, torch.float32, 64, 3 << 19), (1001, torch.float32, 64, 700),
         (1001, torch.float16, 33, 600), (4096, torch.bfloat16, 128, 3 << 19), (777, torch.float32, 7, 1),
         (5000, torch.bfloat16, 64, 5000), (4096, torch.float16, 64, 3 << 19), (4097, torch.float32, 64, 3 << 19)]


@pytest.mark.parametrize("n,dtype,blocksize,budget", CASES, ids=str)
def test_allocates_the_output_and_two_piece_buffers(n, dtype, blocksize, budget):
    """The CPU allocator's own events (torch.profiler): the peak of a real call is the output plus one piece's
    int32 indices and float32 values, never a whole-weight temporary (the replaced lookup held 6 B a weight)."""
    from memlab.profiler import allocator_peak

    packed, absmax = _case(n, blocksize, 0, n, "unit")
    with _budget(budget):
        Q.dequantize_nf4(packed, absmax, (n,), dtype, blocksize)  # the cached table, built once outside
        peak, end = allocator_peak(lambda: Q.dequantize_nf4(packed, absmax, (n,), dtype, blocksize))
        assert (peak, end) == (_expected_bytes(n, dtype, blocksize), 0)


def test_default_budget_on_a_1024_square_weight():
    # bf16: four pieces of 128 KiB packed bytes, buffers 1.5 MiB beside the 2 MiB output; fp32: two pieces of
    # 256 KiB, the index buffer 1 MiB beside the 4 MiB output
    assert B.NF4_DEQUANT_BUFFER_BYTES == 3 << 19
    assert _expected_bytes(1 << 20, torch.bfloat16, 64) == (2 << 20) + (3 << 19)
    assert _expected_bytes(1 << 20, torch.float32, 64) == (4 << 20) + (1 << 20)


@pytest.mark.parametrize("n,dtype,blocksize,budget", CASES, ids=str)
def test_fake_trace_allocates_what_the_real_call_allocates(n, dtype, blocksize, budget, fake_dequantize_bytes):
    """memlab.estimate traces dequantize on fake tensors without computing: its tracker peak equals the
    allocator's peak of the real call (the QLoRA estimate on a CPU equals the real step)."""
    from memlab.profiler import allocator_peak

    packed, absmax = _case(n, blocksize, 0, n, "unit")
    with _budget(budget):
        Q.dequantize_nf4(packed, absmax, (n,), dtype, blocksize)
        real, _ = allocator_peak(lambda: Q.dequantize_nf4(packed, absmax, (n,), dtype, blocksize))
        assert fake_dequantize_bytes(packed, absmax, n, dtype, blocksize) == real


def test_meta_tensors_take_the_allocation_only_path():
    packed, absmax = _case(1000, 64, 0, 0, "unit")
    out = Q.dequantize_nf4(packed.to("meta"), absmax.to("meta"), (10, 100), torch.bfloat16)
    assert out.device.type == "meta" and out.shape == (10, 100) and out.dtype == torch.bfloat16
