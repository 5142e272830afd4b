"""NF4 dequantize's C++ path (issue 42: the CPU dequantize at >= 0.5x bitsandbytes' speed): the same bits as the torch
path for every dtype, block size (odd ones, 1), count and absmax (zeros, -0.0, subnormal, huge, inf, NaN, negative);
the float16 / bfloat16 rounding of every kind of float32; the choice of path forced, read from the environment and
named; the torch fallback where no compiler builds it; only the output allocated, and a fake trace allocating that;
and memlab.core.native, which builds it (and chapter 04's AdamW step) once per source, flags and compiler."""
from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memlab import quant as Q
from memlab.core import native
from memlab.quant import blockwise as B

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
HAVE_CXX = native.find_compiler() is not None
needs_cxx = pytest.mark.skipif(not HAVE_CXX, reason="no C++ compiler here: only the torch path exists")


@contextlib.contextmanager
def _path(name: str):
    # dequantize_nf4's CPU path forced to ``name`` inside the block; the default (the environment's) after it
    try:
        yield B.load_nf4_kernel(name)
    finally:
        B.load_nf4_kernel()


def _both(packed, absmax, shape, dtype, blocksize):
    with _path("cpp") as name:
        assert name.startswith("C++"), name
        fast = Q.dequantize_nf4(packed, absmax, shape, dtype, blocksize)
    with _path("torch") as name:
        assert name == B.NF4_TORCH_NAME
        slow = Q.dequantize_nf4(packed, absmax, shape, dtype, blocksize)
    return fast, slow


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # equal to the bit: a -0.0 is not a 0.0, and NaNs compare by their bits
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(_BITS[a.dtype]), b.view(_BITS[b.dtype]))


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    bad = (a.reshape(-1).view(_BITS[a.dtype]) != b.reshape(-1).view(_BITS[b.dtype])).nonzero().flatten()
    if bad.numel() == 0:
        return "same bits"
    i = int(bad[0])
    return f"{bad.numel()} differ, first at {i}: {a.reshape(-1)[i].item()!r} vs {b.reshape(-1)[i].item()!r}"


SPECIALS = (0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, 1e-40, 3.0e38, -2.5, 65504.0, 65520.0)


def _absmax(nblocks: int, g: torch.Generator, scale: str) -> torch.Tensor:
    a = torch.rand(nblocks, generator=g)
    if scale == "mixed":  # every binade from subnormal to near the float32 maximum
        a = a * 10.0 ** torch.randint(-45, 39, (nblocks,), generator=g).float()
    elif scale == "specials":
        a = torch.tensor(SPECIALS)[torch.randint(0, len(SPECIALS), (nblocks,), generator=g)]
    a[torch.rand(nblocks, generator=g) < 0.1] = 0.0  # all-zero blocks store 0.0
    return a


@needs_cxx
@settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 5000), blocksize=st.sampled_from([64, 32, 128, 4096, 1, 2, 3, 7, 33, 100, 66]),
       dtype=st.sampled_from(DTYPES), extra=st.integers(0, 3), seed=st.integers(0, 2**31 - 1),
       scale=st.sampled_from(["unit", "mixed", "specials"]))
def test_native_equals_the_torch_path_to_the_bit(n, blocksize, dtype, extra, seed, scale):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, ((n + 1) // 2 + extra,), generator=g, dtype=torch.uint8)
    absmax = _absmax(-(-n // blocksize), g, scale)
    fast, slow = _both(packed, absmax, (n,), dtype, blocksize)
    assert _same_bits(fast, slow), _first_difference(fast, slow)


@needs_cxx
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,blocksize", [((1024, 1024), 64), ((300, 257), 128), ((4097, 65), 256), ((513, 1), 64),
                                             ((3, 5, 7), 32), ((1,), 64), ((2, 2048), 4096)], ids=str)
def test_quantized_weights(shape, blocksize, dtype):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)
    packed, absmax = Q.quantize_nf4(w, blocksize)
    fast, slow = _both(packed, absmax, shape, dtype, blocksize)
    assert fast.shape == shape and _same_bits(fast, slow), _first_difference(fast, slow)
    # and the definition: codebook[code] * absmax in float32, rounded once
    codes = Q.unpack_nibbles(packed, w.numel())
    want = (Q.nf4_codebook()[codes] * absmax.repeat_interleave(blocksize)[: w.numel()]).to(dtype)
    assert _same_bits(fast.reshape(-1), want)


@needs_cxx
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("blocksize", [64, 3])  # the vector path and the scalar path (an odd block size)
def test_rounding_of_every_kind_of_float32(dtype, blocksize):
    """Byte 0xFF holds code 15, the level 1.0: each value is its block's absmax rounded to ``dtype``. The absmax
    values run over random bit patterns (every exponent, both signs, NaNs with payloads), the ties of both formats
    and the edges of float16 (its largest finite value, the first value that rounds to inf, subnormals)."""
    g = torch.Generator().manual_seed(7)
    random_bits = torch.randint(-2**31, 2**31 - 1, (20000,), generator=g, dtype=torch.int64)
    base = torch.arange(0, 2**31 - 2**24, 2**24 + 4099, dtype=torch.int64)
    ties = torch.cat([(base & ~0x1FFFF) | 0x8000, (base & ~0x1FFFF) | 0x18000,  # bfloat16's ties: to even, from odd
                      (base & ~0x1FFF) | 0x1000, (base & ~0x1FFF) | 0x3000])    # float16's (normal range)
    bits = torch.cat([random_bits, ties, ties | (1 << 31)]).to(torch.int32)  # int64 -> int32 wraps: both signs
    edges = torch.tensor([65504.0, 65519.0, 65519.996, 65520.0, 65536.0, 6.1e-5, 6.0e-5, 5.96e-8, 2.98e-8, 2.99e-8,
                          1e-45, 0.0, float("inf"), float("nan")])
    absmax = torch.cat([bits.view(torch.float32), edges, -edges])
    n = absmax.numel() * blocksize
    packed = torch.full(((n + 1) // 2,), 0xFF, dtype=torch.uint8)
    with _path("cpp"):
        got = Q.dequantize_nf4(packed, absmax, (n,), dtype, blocksize)
    want = absmax.repeat_interleave(blocksize).to(dtype)
    assert _same_bits(got, want), _first_difference(got, want)


@needs_cxx
def test_threads_change_nothing():
    """Above 64K values the kernel splits the blocks among torch's intra-op threads: the bits do not change."""
    g = torch.Generator().manual_seed(3)
    n = (1 << 18) + 37
    packed = torch.randint(0, 256, ((n + 1) // 2,), generator=g, dtype=torch.uint8)
    absmax = _absmax(-(-n // 64), g, "mixed")
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            with _path("cpp"):
                outs.append(Q.dequantize_nf4(packed, absmax, (n,), torch.bfloat16))
    finally:
        torch.set_num_threads(before)
    with _path("torch"):
        want = Q.dequantize_nf4(packed, absmax, (n,), torch.bfloat16)
    assert all(_same_bits(o, want) for o in outs)


def test_strided_inputs_and_a_float16_absmax():
    """Strided packed and absmax (flattened by a copy, then the C++ path) and a float16 absmax (the torch path) give
    the torch path's values."""
    g = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (2, 400), generator=g, dtype=torch.uint8)
    absmax = torch.rand(5, 5, generator=g)  # 25 blocks of 64
    n = 2 * packed.numel()
    with _path("torch"):
        ref = Q.dequantize_nf4(packed.t().contiguous(), absmax.t().contiguous(), (n,), torch.float32)
        ref16 = Q.dequantize_nf4(packed, absmax, (n,), torch.bfloat16)
    assert not packed.t().is_contiguous() and not absmax.t().is_contiguous()
    assert _same_bits(Q.dequantize_nf4(packed.t(), absmax.t(), (n,), torch.float32), ref)
    half = absmax.half()
    assert _same_bits(Q.dequantize_nf4(packed, half, (n,), torch.bfloat16),
                      Q.dequantize_nf4(packed, half.float(), (n,), torch.bfloat16))
    assert not torch.equal(half.float(), absmax) and ref16.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- choosing and naming the path
def test_forced_paths_and_the_environment(monkeypatch):
    try:
        assert B.load_nf4_kernel("torch") == B.nf4_kernel_name() == B.NF4_TORCH_NAME
        monkeypatch.setenv("MEMLAB_NF4_KERNEL", "torch")
        assert B.load_nf4_kernel() == B.NF4_TORCH_NAME
        monkeypatch.setenv("MEMLAB_NF4_KERNEL", " AUTO ")
        name = B.load_nf4_kernel()
        assert name == (B.NF4_CPP_NAME if HAVE_CXX else name) and name == B.nf4_kernel_name()
        assert name.startswith("C++") or name.startswith("torch")
        with pytest.raises(ValueError, match="kernel='fast'"):
            B.load_nf4_kernel("fast")
        monkeypatch.setenv("MEMLAB_NF4_KERNEL", "gpu")
        with pytest.raises(ValueError, match="kernel='gpu'"):
            B.load_nf4_kernel()
    finally:
        monkeypatch.delenv("MEMLAB_NF4_KERNEL", raising=False)
        B.load_nf4_kernel()


@contextlib.contextmanager
def _fresh_state():
    # the module's loaded kernel forgotten inside the block (as in a new process), restored after it
    saved = B._NF4_KERNEL, B._NF4_KERNEL_NAME
    B._NF4_KERNEL = B._NF4_KERNEL_NAME = None
    try:
        yield
    finally:
        B._NF4_KERNEL, B._NF4_KERNEL_NAME = saved


@pytest.mark.parametrize("how", ["no compiler on PATH", "a compiler that fails"])
def test_fallback_without_a_compiler_gives_the_same_values(how, tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(11)
    packed = torch.randint(0, 256, (1001,), generator=g, dtype=torch.uint8)
    absmax = _absmax(32, g, "mixed")
    want = {dt: Q.dequantize_nf4(packed, absmax, (2001,), dt) for dt in DTYPES}  # the default path
    monkeypatch.setenv("MEMLAB_CACHE", str(tmp_path / "cache"))  # nothing built there yet
    if how == "no compiler on PATH":
        monkeypatch.delenv("CXX", raising=False)
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))
        assert native.find_compiler() is None
    else:
        monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with _fresh_state():
        name = B.load_nf4_kernel("auto")
        assert name == f"{B.NF4_TORCH_NAME} (C++ kernel unavailable: RuntimeError)" == B.nf4_kernel_name()
        for dt in DTYPES:
            assert _same_bits(Q.dequantize_nf4(packed, absmax, (2001,), dt), want[dt])
        B._NF4_KERNEL_NAME = None
        with pytest.raises(RuntimeError, match="NF4 dequantize kernel did not build"):
            B.load_nf4_kernel("cpp")
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


@needs_cxx
def test_the_kernel_builds_from_the_package_source(tmp_path, monkeypatch):
    """nf4.cpp ships beside blockwise.py (package data); a fresh cache gets one library, built once: a second
    load in the process is the same library."""
    assert B.NF4_KERNEL_PATH.parent == Path(B.__file__).parent
    assert 'extern "C" int memlab_nf4_dequantize' in B.NF4_KERNEL_PATH.read_text()
    monkeypatch.setenv("MEMLAB_CACHE", str(tmp_path))
    with _fresh_state():
        assert B.load_nf4_kernel("cpp") == B.NF4_CPP_NAME
        libs = list(tmp_path.iterdir())
        assert len(libs) == 1 and libs[0].name.startswith("memlab_nf4_") and libs[0].suffix == ".so", libs
        first = B._NF4_KERNEL
        B._NF4_KERNEL = B._NF4_KERNEL_NAME = None
        assert B.load_nf4_kernel("cpp") == B.NF4_CPP_NAME and list(tmp_path.iterdir()) == libs
        packed = torch.tensor([0x0F, 0xF7], dtype=torch.uint8)
        out = Q.dequantize_nf4(packed, torch.tensor([2.0]), (3,))
        assert out.tolist() == [-2.0, 2.0, 2.0] and B._NF4_KERNEL is not None
    assert first is not None


# ----------------------------------------------------------------------------- memory
@needs_cxx
@pytest.mark.parametrize("n,dtype,blocksize", [(1 << 20, torch.bfloat16, 64), (1 << 20, torch.float32, 64),
                                               (4097, torch.float16, 33)], ids=str)
def test_allocates_the_output_only_and_a_fake_trace_allocates_that(n, dtype, blocksize, fake_dequantize_bytes):
    """The C++ path's peak (the CPU allocator's events) is its output; memlab.estimate's trace on CPU fake tensors
    (a MemoryTracker under a FakeTensorMode) counts the same bytes, so a CPU QLoRA estimate equals the real step."""
    from memlab.profiler import MemoryTracker, allocator_peak

    g = torch.Generator().manual_seed(n)
    packed = torch.randint(0, 256, ((n + 1) // 2,), generator=g, dtype=torch.uint8)
    absmax = torch.rand(-(-n // blocksize), generator=g)
    with _path("cpp"):
        Q.dequantize_nf4(packed, absmax, (n,), dtype, blocksize)  # the codebook, cached outside
        peak, end = allocator_peak(lambda: Q.dequantize_nf4(packed, absmax, (n,), dtype, blocksize))
        assert (peak, end) == (n * torch.empty(0, dtype=dtype).element_size(), 0)
        assert fake_dequantize_bytes(packed, absmax, n, dtype, blocksize) == peak
        with MemoryTracker() as tracker:  # a tracked real call computes (and counts its output)
            start = tracker.current_bytes
            got = Q.dequantize_nf4(packed, absmax, (n,), dtype, blocksize)
            assert tracker.peak_bytes - start == peak
    with _path("torch"):
        assert _same_bits(got, Q.dequantize_nf4(packed, absmax, (n,), dtype, blocksize))


# ----------------------------------------------------------------------------- memlab.core.native
def test_core_native_imports_no_torch():
    code = "import sys, memlab.core.native; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(native.__file__).parents[2])})
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stdout + r.stderr[-2000:]


@needs_cxx
def test_build_library_once_per_text_and_flags_and_a_failure_names_the_compiler_output(tmp_path):
    src = tmp_path / "twice.cpp"
    src.write_text('extern "C" int memlab_twice(int x) { return 2 * x; }\n')
    cache = tmp_path / "cache"
    lib = native.build_library(src, "twice", cache=cache)
    assert lib.memlab_twice(21) == 42
    assert native.build_library(src, "twice", cache=cache) is lib and len(list(cache.iterdir())) == 1
    native.build_library(src, "twice", (*native.NATIVE_FLAGS, "-O1"), cache=cache)  # other flags: another library
    src.write_text('extern "C" int memlab_twice(int x) { return x + x; }\n')  # other text: another library
    assert native.build_library(src, "twice", cache=cache).memlab_twice(4) == 8
    assert sorted(p.suffix for p in cache.iterdir()) == [".so"] * 3
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++\n")
    with pytest.raises(RuntimeError, match=r"failed \(exit [1-9]\d*\) on bad.cpp:\n.*error"):
        native.build_library(bad, "bad", cache=cache)
    assert sorted(p.suffix for p in cache.iterdir()) == [".so"] * 3  # no half-built file left behind


def test_a_native_build_is_keyed_by_the_cpu(tmp_path, monkeypatch):
    """``-march=native`` code runs only on CPUs with the builder's instructions: a cache folder shared by two
    machines (a home folder on a cluster) must hold one library per CPU, never load another CPU's."""
    args = ("nf4", "extern \"C\" int f() { return 1; }", native.NATIVE_FLAGS, "g++", tmp_path)
    here = native.library_path(*args)
    assert here == native.library_path(*args, cpu=native.cpu_fingerprint())  # read from this machine by default
    other = native.library_path(*args, cpu=native.cpu_fingerprint().replace("avx", "no-avx") + "\nflags: other")
    assert other != here and other.parent == here.parent and other.name.startswith("memlab_nf4_")
    portable = tuple(f for f in native.NATIVE_FLAGS if f != "-march=native")
    # without -march=native the code is the compiler's portable baseline: one library serves every CPU
    assert native.library_path("nf4", args[1], portable, "g++", tmp_path, cpu="a") == \
        native.library_path("nf4", args[1], portable, "g++", tmp_path, cpu="b")
    monkeypatch.setattr(native, "cpu_fingerprint", lambda: "another CPU")
    assert native.library_path(*args) != here
