"""memlab.attention against F.scaled_dot_product_attention: forward, gradients, options, memory, errors."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton on CPU tensors runs in its interpreter, chosen at triton's import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from memlab import attention as att
from memlab.profiler import MemoryTracker

FNS = {
    "naive": att.naive_attention,
    "chunked": lambda q, k, v, **kw: att.chunked_attention(q, k, v, q_chunk=3, kv_chunk=5, **kw),
    "flash": lambda q, k, v, **kw: att.flash_attention(q, k, v, block_q=3, block_k=5, **kw),
}
SHAPES = [  # (Hq, Hkv, Lq, Lk, D, Dv): odd lengths, GQA, Lq != Lk both ways, Dv != D
    (2, 2, 7, 7, 8, 8),
    (4, 2, 5, 11, 8, 6),
    (4, 1, 11, 5, 4, 4),
]
MODES = [False, True, "bottom_right"]


def _inputs(hq, hkv, lq, lk, d, dv, dtype=torch.float64, seed=0, batch=2):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)  # noqa: E731
    return mk(batch, hq, lq, d), mk(batch, hkv, lk, d), mk(batch, hkv, lk, dv)


def _fwd_bwd(fn, q, k, v, do, **kw):
    o = fn(q, k, v, **kw)
    return (o,) + torch.autograd.grad(o, (q, k, v), do)


@pytest.mark.parametrize("name", list(FNS))
@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp64_matches_sdpa_forward_and_backward(name, mode, shape):
    q, k, v = _inputs(*shape)
    o_ref = att.sdpa_reference(q, k, v, causal=mode)
    do = torch.randn_like(o_ref)
    want = (o_ref,) + torch.autograd.grad(o_ref, (q, k, v), do)
    got = _fwd_bwd(FNS[name], q, k, v, do, causal=mode)
    for what, g, w in zip("o dq dk dv".split(), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, what
        assert (g - w).abs().max().item() <= 1e-10, (what, (g - w).abs().max().item())


@pytest.mark.parametrize("name", list(FNS))
def test_fp32_matches_sdpa_with_scale(name):
    q, k, v = _inputs(4, 2, 33, 33, 16, 16, dtype=torch.float32)
    o_ref = att.sdpa_reference(q, k, v, causal=True, scale=0.3)
    do = torch.randn_like(o_ref)
    want = (o_ref,) + torch.autograd.grad(o_ref, (q, k, v), do)
    got = _fwd_bwd(FNS[name], q, k, v, do, causal=True, scale=0.3)
    for what, g, w in zip("o dq dk dv".split(), got, want):
        assert (g - w).abs().max().item() <= 1e-5, (what, (g - w).abs().max().item())


def test_top_left_equals_sdpa_is_causal_and_bottom_right_equals_torch_causal_lower_right():
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = _inputs(2, 2, 5, 9, 8, 8)
    tl = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (att.flash_attention(q, k, v, causal=True, block_q=2, block_k=4) - tl).abs().max() < 1e-12
    br = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(5, 9))
    assert (att.flash_attention(q, k, v, causal="bottom_right", block_q=2, block_k=4) - br).abs().max() < 1e-12
    assert torch.equal(att.causal_mask(3, 5, True), torch.ones(3, 5, dtype=torch.bool).tril())
    assert torch.equal(att.causal_mask(3, 5, "bottom_right"), torch.ones(3, 5, dtype=torch.bool).tril(2))
    assert att.causal_mask(3, 5, False) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(FNS))
def test_half_precision_within_2x_sdpa_error(name, dtype):
    """FlashAttention's criterion: error against an fp64 reference at most 2x SDPA's own (plus a floor)."""
    q, k, v = _inputs(4, 2, 24, 24, 16, 16, dtype=dtype, seed=1)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    o64 = att.sdpa_reference(q64, k64, v64, causal=True)
    do = torch.randn_like(o64)
    truth = (o64,) + torch.autograd.grad(o64, (q64, k64, v64), do)
    o_ref = att.sdpa_reference(q, k, v, causal=True)
    sdpa = (o_ref,) + torch.autograd.grad(o_ref, (q, k, v), do.to(dtype))
    got = _fwd_bwd(FNS[name], q, k, v, do.to(dtype), causal=True)
    floor = 1e-2 if dtype == torch.bfloat16 else 2e-3
    for what, g, s, t in zip("o dq dk dv".split(), got, sdpa, truth):
        assert g.dtype == dtype, what
        err, ref_err = (g.double() - t).abs().max().item(), (s.double() - t).abs().max().item()
        assert err <= 2 * ref_err + floor, (what, err, ref_err)


def test_fully_masked_rows_give_what_sdpa_gives():
    q, k, v = _inputs(2, 2, 9, 4, 8, 8)  # bottom-right with Lq > Lk: the first 5 rows see no key
    mask = att.causal_mask(9, 4, "bottom_right")
    o_ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    do = torch.randn_like(o_ref)
    want = (o_ref,) + torch.autograd.grad(o_ref, (q, k, v), do)
    assert torch.all(o_ref[:, :, :5] == 0)
    for name, fn in FNS.items():
        got = _fwd_bwd(fn, q, k, v, do, causal="bottom_right")
        for g, w in zip(got, want):
            assert not torch.isnan(g).any(), name
            assert (g - w).abs().max() < 1e-10, name
    _, lse = att.chunked_attention(q, k, v, causal="bottom_right", return_lse=True)
    assert torch.all(lse[:, :, :5] == float("-inf")) and torch.isfinite(lse[:, :, 5:]).all()


def test_lse_and_merge_partials():
    q, k, v = _inputs(2, 2, 6, 10, 8, 8)
    o, lse = att.chunked_attention(q, k, v, return_lse=True, kv_chunk=3)
    s = (q @ k.transpose(-1, -2)) / 8 ** 0.5
    assert (lse - torch.logsumexp(s, -1)).abs().max() < 1e-12
    o1, l1 = att.naive_attention(q, k[:, :, :4], v[:, :, :4]), torch.logsumexp(s[..., :4], -1)
    o2, l2 = att.naive_attention(q, k[:, :, 4:], v[:, :, 4:]), torch.logsumexp(s[..., 4:], -1)
    om, lm = att.merge_partials(o1, l1, o2, l2)
    assert (om - o).abs().max() < 1e-12 and (lm - lse).abs().max() < 1e-12
    ninf = torch.full_like(l1, float("-inf"))
    om, lm = att.merge_partials(o1, l1, torch.zeros_like(o2), ninf)
    assert torch.equal(lm, l1) and (om - o1).abs().max() < 1e-15
    om, lm = att.merge_partials(torch.zeros_like(o1), ninf, torch.zeros_like(o2), ninf)
    assert not torch.isnan(om).any() and torch.all(om == 0)
    fo, flse = att.flash_attention(q, k, v, return_lse=True)
    assert (flse - lse).abs().max() < 1e-12 and (fo - o).abs().max() < 1e-12


def test_gradcheck_flash_fp64():
    q, k, v = _inputs(2, 1, 5, 6, 3, 3, batch=1)
    for mode in MODES:
        assert torch.autograd.gradcheck(
            lambda a, b, c: att.flash_attention(a, b, c, causal=mode, block_q=2, block_k=4), (q, k, v))


@pytest.mark.parametrize("block", [(1, 1), (4, 7), (64, 64)])
def test_blocks_that_do_not_divide(block):
    q, k, v = _inputs(2, 2, 13, 13, 8, 8)
    ref = att.sdpa_reference(q, k, v, causal=True)
    assert (att.flash_attention(q, k, v, causal=True, block_q=block[0], block_k=block[1]) - ref).abs().max() < 1e-12
    assert (att.chunked_attention(q, k, v, causal=True, q_chunk=block[0], kv_chunk=block[1]) - ref).abs().max() < 1e-12


# ----------------------------------------------------------------------------- memory
def _saved(fn, seq, **kw):
    q, k, v = _inputs(2, 2, seq, seq, 16, 16, dtype=torch.float32, batch=1)
    return att.attention_saved_bytes(fn, q, k, v, **kw)


def test_saved_bytes_flash_linear_naive_and_chunked_quadratic():
    L = 64
    flash = [_saved(att.flash_attention, s, block_q=16, block_k=16) for s in (L, 4 * L)]
    naive = [_saved(att.naive_attention, s) for s in (L, 4 * L)]
    chunked = [_saved(att.chunked_attention, s, q_chunk=16, kv_chunk=16) for s in (L, 4 * L)]
    assert flash[1] <= 4.2 * flash[0], flash
    assert naive[1] >= 14 * naive[0], naive
    assert chunked[1] >= 12 * chunked[0], chunked
    # flash keeps the output (fp32) and the logsumexp (fp32) only: 2*L*16*4 + 2*L*4 bytes at L=4*64
    s = 4 * L
    assert flash[1] == 2 * s * 16 * 4 + 2 * s * 4
    # the s x s probabilities per head: naive keeps at least them, chunking in autograd as much
    assert naive[1] >= 2 * s * s * 4 and chunked[1] >= 2 * s * s * 4


def test_memory_tracker_peak_forward_backward_flash_below_naive():
    q, k, v = _inputs(2, 2, 256, 256, 16, 16, dtype=torch.float32, batch=1)
    peaks = {}
    for name, fn in (("naive", att.naive_attention),
                     ("flash", lambda a, b, c: att.flash_attention(a, b, c, block_q=32, block_k=32))):
        with MemoryTracker() as tr:
            fn(q, k, v).sum().backward()
        peaks[name] = tr.peak_bytes
    s2 = 2 * 256 * 256 * 4
    assert peaks["naive"] >= 2 * s2  # scores and probabilities at once
    assert peaks["flash"] < s2 and peaks["naive"] >= 5 * peaks["flash"], peaks  # no s x s matrix at all


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kw, words", [
    (dict(causal="top-right"), ["causal='top-right'", "'bottom_right'"]),
    (dict(scale="big"), ["scale='big'"]),
    (dict(scale=float("nan")), ["scale=nan"]),
])
@pytest.mark.parametrize("name", list(FNS))
def test_bad_options_are_named(name, kw, words):
    q, k, v = _inputs(2, 2, 4, 4, 8, 8)
    with pytest.raises(ValueError) as e:
        FNS[name](q, k, v, **kw)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("fn, kw, words", [
    (att.chunked_attention, dict(q_chunk=0), ["q_chunk=0", ">= 1"]),
    (att.chunked_attention, dict(kv_chunk=2.5), ["kv_chunk=2.5"]),
    (att.flash_attention, dict(block_q=-1), ["block_q=-1"]),
    (att.flash_attention, dict(block_k=True), ["block_k=True"]),
    (att.triton_flash_attention, dict(block_q=24), ["block_q=24", "power of two"]),
])
def test_bad_block_sizes(fn, kw, words):
    q, k, v = _inputs(2, 2, 4, 4, 8, 8, dtype=torch.float32)
    with pytest.raises(ValueError) as e:
        fn(q, k, v, **kw)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_bad_shapes_and_dtypes():
    q, k, v = _inputs(3, 2, 4, 4, 8, 8)
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        att.flash_attention(q, k, v)
    q, k, v = _inputs(2, 2, 4, 4, 8, 8)
    with pytest.raises(ValueError, match="4-d"):
        att.naive_attention(q[0], k, v)
    with pytest.raises(ValueError, match="dtypes differ"):
        att.naive_attention(q.float(), k, v)
    with pytest.raises(ValueError, match="head_dim"):
        att.naive_attention(q, k[..., :4], v)
    with pytest.raises(ValueError, match="int64 is not supported"):
        att.naive_attention(q.long(), k.long(), v.long())
    with pytest.raises(ValueError, match="float64 is not supported"):
        att.triton_flash_attention(q, k, v)


# ----------------------------------------------------------------------------- Triton
needs_triton = pytest.mark.skipif(not att.triton_available(), reason="triton is not installed (pip install triton)")


def _interpreter_ok() -> bool:
    if "triton" not in sys.modules:
        return True
    return att.triton_interpreted()


@needs_triton
@pytest.mark.skipif(not _interpreter_ok(), reason="triton was imported without TRITON_INTERPRET=1 in this process")
@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("shape", [(2, 2, 20, 20, 16, 16), (4, 2, 17, 40, 8, 8), (2, 1, 40, 17, 16, 12)],
                         ids=lambda s: "x".join(map(str, s)))
def test_triton_matches_sdpa_under_interpreter(mode, shape):
    q, k, v = _inputs(*shape, dtype=torch.float32, batch=1)
    o_ref = att.sdpa_reference(q, k, v, causal=mode)
    do = torch.randn_like(o_ref)
    want = (o_ref,) + torch.autograd.grad(o_ref, (q, k, v), do)
    got = _fwd_bwd(lambda *a, **kw: att.triton_flash_attention(*a, block_q=16, block_k=16, **kw), q, k, v, do, causal=mode)
    for what, g, w in zip("o dq dk dv".split(), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert (g - w).abs().max().item() <= 1e-5, (what, (g - w).abs().max().item())
    _, lse = att.triton_flash_attention(q, k, v, causal=mode, return_lse=True)
    _, lse_ref = att.chunked_attention(q, k, v, causal=mode, return_lse=True)
    assert torch.allclose(lse, lse_ref, atol=1e-5, rtol=0) or torch.equal(lse.isinf(), lse_ref.isinf())


@needs_triton
@pytest.mark.skipif(not _interpreter_ok(), reason="triton was imported without TRITON_INTERPRET=1 in this process")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_triton_matches_sdpa_half_precision_within_2x_sdpa_error(dtype):
    q, k, v = _inputs(4, 2, 40, 40, 16, 16, dtype=dtype, seed=2, batch=1)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    o64 = att.sdpa_reference(q64, k64, v64, causal=True)
    do = torch.randn_like(o64)
    truth = (o64,) + torch.autograd.grad(o64, (q64, k64, v64), do)
    o_ref = att.sdpa_reference(q, k, v, causal=True)
    sdpa = (o_ref,) + torch.autograd.grad(o_ref, (q, k, v), do.to(dtype))
    got = _fwd_bwd(lambda *a, **kw: att.triton_flash_attention(*a, block_q=16, block_k=16, **kw), q, k, v,
                   do.to(dtype), causal=True)
    floor = 1e-2 if dtype == torch.bfloat16 else 2e-3
    for what, g, s_, t in zip("o dq dk dv".split(), got, sdpa, truth):
        assert g.dtype == dtype, what
        err, ref_err = (g.double() - t).abs().max().item(), (s_.double() - t).abs().max().item()
        assert err <= 2 * ref_err + floor, (what, err, ref_err)


@needs_triton
@pytest.mark.skipif(not _interpreter_ok(), reason="triton was imported without TRITON_INTERPRET=1 in this process")
def test_triton_kernels_live_at_module_level():
    from memlab.attention import triton_kernels as at

    assert att.load_triton_kernels() is at
    for name in ("fwd", "bwd_dq", "bwd_dkdv", "flash_fwd_kernel"):
        fn = getattr(at, name).fn
        assert fn.__module__ == "memlab.attention.triton_kernels" and fn.__qualname__ == name, (name, fn.__qualname__)


@needs_triton
@pytest.mark.skipif(not _interpreter_ok(), reason="triton was imported without TRITON_INTERPRET=1 in this process")
@pytest.mark.parametrize("lq,lk,causal", [(37, 53, True), (37, 53, False), (53, 37, False), (1, 40, True),
                                          (40, 40, True), (16, 17, True), (53, 37, True), (40, 24, True)])
def test_lab_kernel_bottom_right_odd_sizes_any_strides(lq, lk, causal):
    """memlab.attention.triton_kernels.flash_fwd_kernel (lab 05's answer): bottom-right causal, tails, strided q and k."""
    from memlab.attention.triton_kernels import flash_fwd_kernel, launch_flash_fwd

    g = torch.Generator().manual_seed(lq * lk)
    q = torch.randn(2, lq, 2, 16, generator=g).transpose(1, 2)
    k = torch.randn(2, 2, 16, lk, generator=g).transpose(-1, -2)
    v = torch.randn(2, 2, lk, 16, generator=g)
    o, lse = launch_flash_fwd(flash_fwd_kernel, q, k, v, causal)
    mode = "bottom_right" if causal else False
    assert (o - att.sdpa_reference(q, k, v, causal=mode)).abs().max().item() <= 1e-5
    _, lse_ref = att.chunked_attention(q, k, v, causal=mode, return_lse=True)
    seen = torch.isfinite(lse_ref)  # bottom-right with Lq > Lk: the first Lq - Lk queries see no key, LSE -inf
    assert lse.dtype == torch.float32 and torch.equal(torch.isfinite(lse), seen) and not o.isnan().any()
    assert (lse[seen] - lse_ref[seen]).abs().max().item() <= 1e-5


LECTURE_05 = Path(__file__).resolve().parents[2] / "notebooks" / "05_chunked_attention.ipynb"


def _lecture_triton_forward(tmp_path, notebook=LECTURE_05):
    """The lecture's on-page Triton forward: the one code cell that defines ``flash_fwd_kernel``, imported
    from a file (Triton's jit reads a kernel's source with ``inspect``)."""
    cells = json.loads(Path(notebook).read_text())["cells"]
    found = ["".join(c["source"]) for c in cells
             if c["cell_type"] == "code" and "def flash_fwd_kernel" in "".join(c["source"])]
    assert len(found) == 1, f"{len(found)} cells of {notebook} define flash_fwd_kernel"
    path = tmp_path / "lecture05_triton_forward.py"
    path.write_text(found[0])
    spec = importlib.util.spec_from_file_location(f"lecture05_triton_forward_{tmp_path.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.flash_fwd_kernel


@needs_triton
@pytest.mark.skipif(not _interpreter_ok(), reason="triton was imported without TRITON_INTERPRET=1 in this process")
@pytest.mark.parametrize("lq,lk", [(53, 37), (40, 24), (45, 37), (17, 1)])  # whole query blocks or part of one blind
def test_lecture_triton_forward_more_queries_than_keys_bottom_right(tmp_path, lq, lk):
    """Bottom-right with Lq > Lk: the first Lq - Lk queries see no key. SDPA gives them 0; the lecture's
    kernel gave NaN (a running max of -inf: exp(-inf + inf), then 0 / 0) until it kept a safe max and sum
    (45/37: a query block whose first 8 rows see no key also gave a NaN logsumexp)."""
    from memlab.attention.triton_kernels import launch_flash_fwd

    g = torch.Generator().manual_seed(lq * lk)
    q = torch.randn(1, lq, 2, 16, generator=g).transpose(1, 2)  # strided, as in the lecture
    k = torch.randn(1, 2, 16, lk, generator=g).transpose(-1, -2)
    v = torch.randn(1, 2, lk, 16, generator=g)
    o, lse = launch_flash_fwd(_lecture_triton_forward(tmp_path), q, k, v, True)
    ref = att.sdpa_reference(q, k, v, causal="bottom_right")
    nan_rows = int(o.isnan().any(-1).sum())
    assert nan_rows == 0, f"Lq={lq} Lk={lk}: {nan_rows} NaN rows (the {lq - lk} x 2 heads that see no key)"
    assert (o - ref).abs().max().item() <= 1e-5 and torch.all(o[:, :, :lq - lk] == 0)
    _, lse_ref = att.chunked_attention(q, k, v, causal="bottom_right", return_lse=True)
    assert torch.all(lse[:, :, :lq - lk] == float("-inf"))
    assert (lse[:, :, lq - lk:] - lse_ref[:, :, lq - lk:]).abs().max().item() <= 1e-5


@needs_triton
def test_triton_in_a_fresh_process_when_this_one_cannot_interpret():
    """Another test module may have imported triton before TRITON_INTERPRET was set: run them afresh."""
    if _interpreter_ok() or torch.cuda.is_available():
        pytest.skip("the Triton tests run in this process")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                        "triton_matches_sdpa"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "11 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


# ----------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["flash", "triton"])
def test_cuda_matches_sdpa(name, dtype):
    if name == "triton" and not att.triton_available():
        pytest.skip("triton is not installed")
    if name == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1: the compiled kernels are not under test")
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=g, dtype=dtype).requires_grad_(True)  # noqa: E731
    q, k, v = mk(2, 8, 300, 64), mk(2, 4, 300, 64), mk(2, 4, 300, 64)
    fn = att.flash_attention if name == "flash" else att.triton_flash_attention
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    o64 = att.sdpa_reference(q64, k64, v64, causal=True)
    do = torch.randn_like(o64)
    truth = (o64,) + torch.autograd.grad(o64, (q64, k64, v64), do)
    o_ref = att.sdpa_reference(q, k, v, causal=True)
    sdpa = (o_ref,) + torch.autograd.grad(o_ref, (q, k, v), do.to(dtype))
    got = _fwd_bwd(fn, q, k, v, do.to(dtype), causal=True)
    floor = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    for what, gg, s, t in zip("o dq dk dv".split(), got, sdpa, truth):
        err, ref_err = (gg.double() - t).abs().max().item(), (s.double() - t).abs().max().item()
        assert err <= 2 * ref_err + floor, (what, err, ref_err)


def test_bench_attention_runs_and_names_the_device(capsys):
    from memlab.bench import attention as bench

    assert bench.main(["--seqs", "32,64", "--repeat", "1", "--heads", "2", "--head-dim", "16", "--block", "16"]) == 0
    out = capsys.readouterr().out
    assert "device: " in out and "sdpa-flash" in out and "speed vs sdpa-flash" in out and "targets" in out


def test_transformers_tiny_llama_trains_the_same_with_memlab_attention():
    pytest.importorskip("transformers")
    from memlab.models import tiny_llama

    name = att.register_transformers()
    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    losses, peaks = {}, {}
    for impl in ("eager", "sdpa", name):
        torch.manual_seed(0)
        model = tiny_llama(attn_implementation=impl)
        assert model.config._attn_implementation == impl
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[impl] = []
        for _ in range(2):
            with MemoryTracker(model, opt) as tr:
                loss = model(input_ids=x, labels=x).loss
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses[impl].append(loss.item())
        peaks[impl] = max(e.bytes["activations"] for e in tr.timeline)
    for a, b in zip(losses[name], losses["sdpa"]):
        assert abs(a - b) <= 1e-5, losses  # fp32: same losses to 1e-5
    for a, b in zip(losses[name], losses["eager"]):
        assert abs(a - b) <= 1e-5, losses
    assert peaks[name] < peaks["eager"], peaks
    with pytest.raises(ValueError, match="impl='fast'"):
        att.register_transformers(impl="fast")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["flash", "triton"])
def test_cuda_peak_is_linear_in_seq(name):
    """max_memory_allocated of fwd+bwd (net of the inputs): at 4L at most 4.2x that at L; SDPA math quadratic."""
    if name == "triton" and (not att.triton_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("needs compiled triton")
    fn = {"flash": lambda q, k, v: att.flash_attention(q, k, v, causal=True),
          "triton": lambda q, k, v: att.triton_flash_attention(q, k, v, causal=True)}[name]

    def peak(f, s):
        q, k, v = (torch.randn(1, 8, s, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        f(q, k, v).sum().backward()  # warm-up (compilation, workspaces)
        q.grad = k.grad = v.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        f(q, k, v).sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    small, large = peak(fn, 2048), peak(fn, 8192)
    assert large <= 4.2 * small, (small, large)
    naive_small, naive_large = peak(att.naive_attention, 1024), peak(att.naive_attention, 4096)
    assert naive_large >= 12 * naive_small, (naive_small, naive_large)


@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_flash_split_across_threads_equals_one_thread(causal, monkeypatch):
    # on a CPU the batch-and-heads rows are split between Python threads (one intra-op thread each): the
    # output and the gradients are those of one thread, bit for bit, and torch's thread count is restored
    import memlab.attention.flash as fl

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 40, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 33 if causal == "bottom_right" else 40, 16, generator=g, requires_grad=True)
            for _ in range(2))
    do = torch.randn(2, 4, 40, 16, generator=g)
    results = []
    before = torch.get_num_threads()
    for threads, min_work in ((1, 1 << 40), (3, 1)):
        monkeypatch.setattr(fl, "MIN_WORK_PER_THREAD", min_work)
        torch.set_num_threads(threads)
        try:
            q.grad = k.grad = v.grad = None
            o = att.flash_attention(q, k, v, causal=causal, block_q=8, block_k=16)
            o.backward(do)
            results.append([o.detach().clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()])
        finally:
            torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert torch.get_num_threads() == before
