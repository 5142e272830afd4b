"""memlab.offload: the AdamW update bitwise against torch, the fast CPU step, OffloadedAdamW, layer streaming."""
from __future__ import annotations

import copy
import pathlib

import pytest
import torch
from torch import nn

from memlab import offload as O

HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)


def _mlp(dtype=torch.float32, device="cpu", widths=(12, 40, 40, 5)) -> nn.Module:
    torch.manual_seed(0)
    a, b, c, d = widths
    return nn.Sequential(nn.Linear(a, b), nn.GELU(), nn.Linear(b, c), nn.GELU(), nn.Linear(c, d)).to(device, dtype)


# torch's fused CPU AdamW finishes each thread's range with a scalar loop that rounds differently from
# its vector loop; with one thread and sizes that are multiples of 16 every element takes the vector loop.
TAIL_FREE = (16, 32, 32, 16)


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def all_workers(monkeypatch):
    """The eager step always runs every worker it may (not the count it measured to be faster)."""
    from memlab.offload import kernel as K

    class Most:
        def pick(self, n, most):
            return most

        def record(self, n, workers, seconds):
            pass

    monkeypatch.setattr(K, "_WORKERS", Most())


def _pair(kernel, dtype=torch.float32):
    """(our model, reference model, reference optimizer class kwargs) for a kernel."""
    widths = TAIL_FREE if kernel == "fast" else (12, 40, 40, 5)
    ref_kw = dict(fused=True) if kernel == "fast" else dict(foreach=False)
    return _mlp(dtype, widths=widths), _mlp(dtype, widths=widths), ref_kw


def _batches(n, device="cpu", dtype=torch.float32, model=None):
    gen = torch.Generator().manual_seed(1)
    din = model[0].in_features if model is not None else 12
    dout = model[-1].out_features if model is not None else 5
    return [(torch.randn(16, din, generator=gen).to(device, dtype), torch.randn(16, dout, generator=gen).to(device, dtype))
            for _ in range(n)]


def _loss(model, x, y):
    return (model(x).float() - y.float()).pow(2).mean()


# ----------------------------------------------------------------------------- the update rule
@pytest.mark.parametrize("n", [1, 7, 1000, 4099])
@pytest.mark.parametrize("hp", [HP, dict(lr=3e-4, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.0),
                                dict(lr=1e-3, beta1=0.3, beta2=0.9, eps=1e-8, weight_decay=0.1)])
def test_update_rule_bitwise_vs_torch_for_loop(n, hp):
    torch.manual_seed(n)
    p0 = torch.randn(n)
    ref = nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                            weight_decay=hp["weight_decay"], foreach=False)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for step in range(1, 11):
        g = torch.randn(n)
        ref.grad = g.clone()
        opt.step()
        O.adamw_step_(p, g, m, v, step, **hp)
        assert torch.equal(p, ref.data), f"step {step}"
        assert torch.equal(m, opt.state[ref]["exp_avg"]) and torch.equal(v, opt.state[ref]["exp_avg_sq"])


@pytest.mark.parametrize("n", [5, 1000, 100_003])
def test_fast_step_bitwise_vs_eager_chunked_and_torch_fused(n, one_thread):
    torch.manual_seed(0)
    p0 = torch.randn(n)
    ref = nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=HP["lr"], eps=HP["eps"], weight_decay=HP["weight_decay"], fused=True)
    fast = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    eager = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    loop = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    for step in range(1, 6):
        g = torch.randn(n)
        ref.grad = g.clone()
        opt.step()
        O.adamw_step_flat_(fast[0], g, fast[1], fast[2], step, chunk=333, **HP)
        O.adamw_step_eager_chunked_(eager[0], g, eager[1], eager[2], step, chunk=1000, **HP)
        O.adamw_step_(loop[0], g, loop[1], loop[2], step, **HP)
    vector_part = n - n % 16  # torch's fused kernel: vector loop here, scalar loop after
    assert torch.equal(fast[0][:vector_part], ref.data[:vector_part]), O.kernel_name()
    assert torch.allclose(fast[0], ref.data, rtol=1e-6, atol=1e-7)
    for a, b in zip(fast, eager):
        assert torch.equal(a, b)
    # the for-loop's sqrt is not correctly rounded on CPU: a few ulp apart, never more
    assert torch.allclose(loop[0], fast[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_eager_chunked_step_is_the_same_at_any_thread_count_and_restores_torch_threads(threads, monkeypatch,
                                                                                     all_workers):
    # every slice is stepped once, on at most `threads` threads, each with torch's intra-op threads at 1
    # (no op inside a slice is split); the result is the one-thread result, and the caller's intra-op
    # thread count is back after the step
    import threading

    from memlab.offload import kernel as K

    torch.manual_seed(0)
    n = 10 * 1000 + 17
    bufs = [torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)]
    ref = [t.clone() for t in bufs]
    before = torch.get_num_threads()
    seen = []
    real = K._step_chunk

    def spy(p, *a, **kw):
        seen.append((p.storage_offset(), p.numel(), torch.get_num_threads(), threading.get_ident()))
        return real(p, *a, **kw)

    monkeypatch.setattr(K, "_step_chunk", spy)
    monkeypatch.setattr(K, "MIN_PER_WORKER", 1000)  # small buffers get one worker: let this one be split
    for step in (1, 2):
        seen.clear()
        O.adamw_step_eager_chunked_(*bufs, step, chunk=1000, threads=threads, **HP)
        assert sorted((o, k) for o, k, _, _ in seen) == [(i * 1000, min(1000, n - i * 1000)) for i in range(11)]
        assert {t for _, _, t, _ in seen} == {1}, seen  # no op inside a slice is split across threads
        assert len({w for _, _, _, w in seen}) <= threads
        O.adamw_step_eager_chunked_(*ref, step, chunk=1000, threads=1, **HP)
    assert all(torch.equal(a, b) for a, b in zip(bufs, ref))
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads"):
        O.adamw_step_eager_chunked_(*bufs, 1, threads=0, **HP)
    with pytest.raises(ValueError, match="chunk"):
        O.adamw_step_eager_chunked_(*bufs, 1, chunk=0, **HP)


def test_eager_step_default_slices_bitwise_vs_fused_at_two_threads(monkeypatch, all_workers):
    # the default slice (EAGER_CHUNK, larger than the C++ kernel's) with two workers: torch's fused AdamW
    # on its vector loop (one torch thread, a multiple of 16) and the C++ kernel where it builds
    from memlab.offload import kernel as K

    monkeypatch.setattr(K, "MIN_PER_WORKER", K.EAGER_CHUNK)
    n = 3 * K.EAGER_CHUNK + 16 * 7
    torch.manual_seed(1)
    p0 = torch.randn(n)
    ref = nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=HP["lr"], eps=HP["eps"], weight_decay=HP["weight_decay"], fused=True)
    eager, flat = [p0.clone(), torch.zeros(n), torch.zeros(n)], [p0.clone(), torch.zeros(n), torch.zeros(n)]
    threads = torch.get_num_threads()
    for step in range(1, 4):
        g = torch.randn(n)
        ref.grad = g.clone()
        torch.set_num_threads(1)
        try:
            opt.step()
        finally:
            torch.set_num_threads(threads)
        O.adamw_step_eager_chunked_(eager[0], g, eager[1], eager[2], step, threads=2, **HP)
        O.adamw_step_flat_(flat[0], g, flat[1], flat[2], step, **HP)
    assert torch.equal(eager[0], ref.data)
    assert torch.equal(eager[1], opt.state[ref]["exp_avg"]) and torch.equal(eager[2], opt.state[ref]["exp_avg_sq"])
    assert all(torch.equal(a, b) for a, b in zip(eager, flat)), O.kernel_name()


def test_eager_step_keeps_its_helper_threads_between_calls(monkeypatch, all_workers):
    # helpers are started once and reused: repeated steps do not start new threads
    import threading

    from memlab.offload import kernel as K

    monkeypatch.setattr(K, "MIN_PER_WORKER", 1000)
    bufs = [torch.randn(20_000), torch.randn(20_000), torch.zeros(20_000), torch.zeros(20_000)]
    O.adamw_step_eager_chunked_(*bufs, 1, chunk=1000, threads=3, **HP)
    helpers = list(K._HELPERS.threads)
    assert len(helpers) >= 2 and all(t.daemon and t.is_alive() for t in helpers)
    count = threading.active_count()
    for step in range(2, 12):
        O.adamw_step_eager_chunked_(*bufs, step, chunk=1000, threads=3, **HP)
    assert K._HELPERS.threads == helpers and threading.active_count() == count


def test_eager_step_does_not_wait_for_a_helper_that_never_runs(monkeypatch, all_workers):
    # a helper that is not scheduled (a busy machine) leaves its share to the caller: the step finishes
    # on the calling thread alone, with the same result
    from memlab.offload import kernel as K

    offered = []
    monkeypatch.setattr(K, "MIN_PER_WORKER", 1000)
    monkeypatch.setattr(K._HELPERS, "submit", lambda job, k: offered.append(k))
    torch.manual_seed(0)
    bufs = [torch.randn(9_001), torch.randn(9_001), torch.zeros(9_001), torch.zeros(9_001)]
    ref = [t.clone() for t in bufs]
    O.adamw_step_eager_chunked_(*bufs, 1, chunk=1000, threads=2, **HP)
    O.adamw_step_eager_chunked_(*ref, 1, chunk=1000, threads=1, **HP)
    assert offered == [1] and all(torch.equal(a, b) for a, b in zip(bufs, ref))


def test_eager_step_raises_a_helpers_error_on_the_caller(monkeypatch, all_workers):
    import threading

    from memlab.offload import kernel as K

    main = threading.get_ident()
    real = K._step_chunk
    helper_ran = threading.Event()

    def failing_on_helpers(*a, **kw):
        if threading.get_ident() != main:
            helper_ran.set()
            raise RuntimeError("boom on a helper")
        helper_ran.wait(5)  # let the helper claim a slice before the caller takes them all
        return real(*a, **kw)

    monkeypatch.setattr(K, "MIN_PER_WORKER", 1000)
    monkeypatch.setattr(K, "_step_chunk", failing_on_helpers)
    bufs = [torch.randn(8_000), torch.randn(8_000), torch.zeros(8_000), torch.zeros(8_000)]
    with pytest.raises(RuntimeError, match="boom on a helper"):
        O.adamw_step_eager_chunked_(*bufs, 1, chunk=1000, threads=2, **HP)
    assert helper_ran.is_set()
    monkeypatch.setattr(K, "_step_chunk", real)
    O.adamw_step_eager_chunked_(*bufs, 2, chunk=1000, threads=2, **HP)  # the helpers still serve the next step
    assert torch.isfinite(bufs[0]).all()


def test_worker_count_runs_the_faster_and_remeasures_the_other():
    from memlab.offload import kernel as K

    w = K._WorkerCount()
    n = 6_000_000
    assert w.pick(n, 1) == 1  # one thread asked: nothing to choose
    assert w.pick(n, 2) == 2  # nothing measured yet: the helpers first
    w.record(n, 2, 0.050)  # a first step (page faults, helpers starting) is not kept
    assert w.pick(n, 2) == 2
    w.record(n, 2, 0.010)
    assert w.pick(n, 2) == 1  # then one worker, likewise twice
    w.record(n, 1, 0.030)
    assert w.pick(n, 2) == 1
    w.record(n, 1, 0.017)
    picks = [w.pick(n, 2) for _ in range(2 * K.REMEASURE_EVERY)]
    assert picks.count(1) == 2 and picks.count(2) == 2 * K.REMEASURE_EVERY - 2  # the slower, once in REMEASURE_EVERY
    w.record(n, 2, 0.030)  # a busy moment: the least of the last 3 steps still says 2 workers
    assert w.pick(n, 2) == 2
    w.record(n, 2, 0.030)
    w.record(n, 2, 0.030)  # the second core stays busy: one worker from now on
    assert w.pick(n, 2) == 1
    assert w.pick(100, 2) == 2  # another size class is measured apart


def test_eager_step_falls_back_to_one_worker_when_helpers_slow_it(monkeypatch):
    # helpers that cost more than they save (here: waking them takes 20 ms) are measured and left out,
    # but for one call in REMEASURE_EVERY
    import time

    from memlab.offload import kernel as K

    monkeypatch.setattr(K, "_WORKERS", K._WorkerCount())
    monkeypatch.setattr(K, "MIN_PER_WORKER", 1000)
    offered = []
    monkeypatch.setattr(K._HELPERS, "submit", lambda job, k: (offered.append(k), time.sleep(0.02)))
    bufs = [torch.randn(8_000), torch.randn(8_000), torch.zeros(8_000), torch.zeros(8_000)]
    calls = 4 * K.REMEASURE_EVERY
    for step in range(1, calls + 1):
        O.adamw_step_eager_chunked_(*bufs, step, chunk=1000, threads=2, **HP)
    assert 2 <= len(offered) <= 2 + calls // K.REMEASURE_EVERY, offered  # a first step, one measured, re-measures


def test_eager_step_of_an_empty_buffer_returns():
    e = [torch.zeros(0) for _ in range(4)]
    O.adamw_step_eager_chunked_(*e, 1, threads=2, **HP)


def test_intra_op_threads_nests_and_restores():
    before = torch.get_num_threads()
    with O.intra_op_threads(1):
        assert torch.get_num_threads() == 1
        with O.intra_op_threads(1):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="boom"):
        with O.intra_op_threads(1):
            raise RuntimeError("boom")
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="n"):
        with O.intra_op_threads(0):
            pass


def test_eager_fallback_is_named(monkeypatch):
    assert "C++" in O.load_kernel() or "eager" in O.load_kernel()
    try:
        assert O.load_kernel("eager").startswith("eager")
        p, g, m, v = torch.ones(10), torch.ones(10), torch.zeros(10), torch.zeros(10)
        O.adamw_step_flat_(p, g, m, v, 1, **HP)
        assert torch.isfinite(p).all()
    finally:
        assert O.load_kernel("auto") == O.kernel_name()  # back to the default for the other tests


def test_the_kernel_builds_from_the_package_source(tmp_path, monkeypatch):
    """The C++ source ships beside memlab/offload/kernel.py (package data) and g++ compiles that file:
    a fresh cache gets the library and no copy of the source."""
    import shutil

    from memlab.offload import kernel as K

    assert K.KERNEL_PATH.parent == pathlib.Path(O.__file__).parent and K.KERNEL_PATH.suffix == ".cpp"
    assert O.KERNEL_SOURCE == K.KERNEL_PATH.read_text() and 'extern "C" void memlab_adamw' in O.KERNEL_SOURCE
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no C++ compiler here")
    monkeypatch.setenv("MEMLAB_CACHE", str(tmp_path))
    saved = K._KERNEL, K._KERNEL_NAME
    try:
        K._KERNEL = K._KERNEL_NAME = None
        assert O.load_kernel("cpp").startswith("C++")
        assert [p.suffix for p in tmp_path.iterdir()] == [".so"], list(tmp_path.iterdir())
        p, g, m, v = torch.ones(40), torch.full((40,), 0.5), torch.zeros(40), torch.zeros(40)
        ref = [t.clone() for t in (p, g, m, v)]
        O.adamw_step_flat_(p, g, m, v, 1, **HP)
        O.adamw_step_eager_chunked_(ref[0], ref[1], ref[2], ref[3], 1, **HP)
        assert torch.equal(p, ref[0]) and torch.equal(m, ref[2]) and torch.equal(v, ref[3])
    finally:
        K._KERNEL, K._KERNEL_NAME = saved


@pytest.mark.parametrize("text,n", [("10M", 10_000_000), ("2500000", 2_500_000), ("1e6", 10**6), ("1.5k", 1500),
                                    ("2G", 2 * 10**9)])
def test_bench_sizes_are_parameter_counts(text, n):
    from memlab.bench.offload import parse_count

    assert parse_count(text) == n


@pytest.mark.parametrize("text", ["1B", "1MiB", "0", "0.2", "ten", "-5M", ""])
def test_bench_sizes_refuse_bytes_and_non_counts(text):
    from memlab.bench.offload import parse_count

    with pytest.raises(ValueError, match="--sizes=") as e:
        parse_count(text)
    assert f"--sizes={text!r} is invalid" in str(e.value) and "number of parameters" in str(e.value), str(e.value)


def test_bias_corrections():
    assert O.bias_corrections(1, 0.9, 0.999) == (1 - 0.9, 1 - 0.999)
    bc1, bc2 = O.bias_corrections(10, 0.9, 0.999)
    assert bc1 == 1 - 0.9**10 and bc2 == 1 - 0.999**10


def test_pack_views_share_storage():
    ts = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2, 2)]
    buf = O.pack(ts)
    assert buf.flat.numel() == 12 + 5 + 8 and buf.offsets == [0, 12, 17, 25]
    for v, t in zip(buf.views, ts):
        assert v.shape == t.shape and torch.equal(v, t)
        assert v.untyped_storage().data_ptr() == buf.flat.untyped_storage().data_ptr()
    buf.flat.fill_(2.0)
    assert all((v == 2).all() for v in buf.views)


# ----------------------------------------------------------------------------- OffloadedAdamW
@pytest.mark.parametrize("kernel", ["exact", "fast"])
@pytest.mark.parametrize("overlap,offload_gradients", [(True, False), (False, False), (True, True)])
def test_offloaded_fp32_bitwise_vs_torch_adamw(kernel, overlap, offload_gradients, one_thread):
    ref, mine, ref_kw = _pair(kernel)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.05, **ref_kw)
    opt = O.OffloadedAdamW(mine.parameters(), lr=1e-2, weight_decay=0.05, overlap=overlap,
                           offload_gradients=offload_gradients, kernel=kernel)
    for x, y in _batches(6, model=mine):
        for m, o in ((ref, ref_opt), (mine, opt)):
            o.zero_grad()
            _loss(m, x, y).backward()
            o.step()
        for p, q in zip(ref.parameters(), mine.parameters()):
            assert torch.equal(p, q)
    if offload_gradients:
        assert all(p.grad is None for p in mine.parameters())


@pytest.mark.parametrize("kernel", ["exact", "fast"])
def test_offloaded_bf16_equals_bf16_model_with_fp32_master_adamw(kernel, one_thread):
    ref, mine, ref_kw = _pair(kernel, torch.bfloat16)
    masters = [nn.Parameter(p.detach().float()) for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=1e-2, **ref_kw)
    opt = O.OffloadedAdamW(mine.parameters(), lr=1e-2, kernel=kernel)
    for x, y in _batches(5, dtype=torch.bfloat16, model=mine):
        for m in (ref, mine):
            m.zero_grad()
            _loss(m, x, y).backward()
        for mp, p in zip(masters, ref.parameters()):
            mp.grad = p.grad.float()
        ref_opt.step()
        with torch.no_grad():
            for mp, p in zip(masters, ref.parameters()):
                p.copy_(mp)
        opt.step()
        for p, q in zip(ref.parameters(), mine.parameters()):
            assert q.dtype == torch.bfloat16 and torch.equal(p, q)
        for mp, q in zip(masters, mine.parameters()):
            assert torch.equal(mp.data, opt.state[q]["master"])


@pytest.mark.parametrize("kernel", ["exact", "fast"])
def test_state_dict_resume_gives_identical_trajectory(kernel):
    model = _mlp()
    opt = O.OffloadedAdamW(model.parameters(), lr=1e-2, kernel=kernel)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    batches = _batches(8)
    for x, y in batches[:4]:
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()
        sched.step()
    saved_model, saved_opt, saved_sched = (copy.deepcopy(s.state_dict()) for s in (model, opt, sched))
    for x, y in batches[4:]:
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()
        sched.step()
    model2 = _mlp()
    model2.load_state_dict(saved_model)
    opt2 = O.OffloadedAdamW(model2.parameters(), lr=1.0, kernel=kernel)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    opt2.load_state_dict(saved_opt)
    sched2.load_state_dict(saved_sched)
    assert opt2.param_groups[0]["lr"] == 1e-2 / 4  # two halvings
    for x, y in batches[4:]:
        opt2.zero_grad()
        _loss(model2, x, y).backward()
        opt2.step()
        sched2.step()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_state_dict_resume_restores_bf16_masters():
    model = _mlp(torch.bfloat16)
    opt = O.OffloadedAdamW(model.parameters(), lr=1e-2)
    for x, y in _batches(3, dtype=torch.bfloat16):
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    model2 = _mlp(torch.bfloat16)  # fresh weights: the masters in the optimizer state restore them
    opt2 = O.OffloadedAdamW(model2.parameters())
    opt2.load_state_dict(saved)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q) and torch.equal(opt.state[p]["master"], opt2.state[q]["master"])
        assert opt2.state[q]["master"].dtype == torch.float32


@pytest.mark.parametrize("kernel", ["exact", "fast"])
@pytest.mark.parametrize("offload_gradients", [False, True])
def test_grad_accumulation(kernel, offload_gradients, one_thread):
    ref, mine, ref_kw = _pair(kernel)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, **ref_kw)
    opt = O.OffloadedAdamW(mine.parameters(), lr=1e-2, offload_gradients=offload_gradients, kernel=kernel)
    batches = _batches(6, model=mine)
    for k in range(0, 6, 3):
        for m, o in ((ref, ref_opt), (mine, opt)):
            o.zero_grad()
            for x, y in batches[k:k + 3]:
                (_loss(m, x, y) / 3).backward()
            o.step()
    for p, q in zip(ref.parameters(), mine.parameters()):
        assert torch.equal(p, q)


def test_clip_grad_norm_matches_torch():
    ref, mine, ref_kw = _pair("exact")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, **ref_kw)
    opt = O.OffloadedAdamW(mine.parameters(), lr=1e-2, kernel="exact")
    for x, y in _batches(4):
        for m in (ref, mine):
            m.zero_grad()
            (_loss(m, x, y) * 100).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5, foreach=False)
        got = opt.clip_grad_norm_(0.5)
        assert torch.equal(got, want) and got > 0.5
        ref_opt.step()
        opt.step()
        for p, q in zip(ref.parameters(), mine.parameters()):
            assert torch.equal(p, q)


def test_param_without_grad_is_skipped_like_torch():
    ref, mine, ref_kw = _pair("exact")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, **ref_kw)
    opt = O.OffloadedAdamW(mine.parameters(), lr=1e-2, kernel="exact")
    for i, (x, y) in enumerate(_batches(4)):
        for m, o in ((ref, ref_opt), (mine, opt)):
            o.zero_grad()
            _loss(m, x, y).backward()
            if i == 1:
                m[0].bias.grad = None
            o.step()
    for p, q in zip(ref.parameters(), mine.parameters()):
        assert torch.equal(p, q)


def test_bad_arguments_name_the_argument():
    ps = list(_mlp().parameters())
    for kw, word in ((dict(lr=-1.0), "lr=-1.0"), (dict(betas=(1.0, 0.9)), "beta1=1.0"), (dict(betas=(0.9,)), "betas="),
                     (dict(eps=0.0), "eps=0.0"), (dict(weight_decay=-0.1), "weight_decay=-0.1"),
                     (dict(overlap="yes"), "overlap='yes'"), (dict(pin_memory=1), "pin_memory=1"),
                     (dict(kernel="cuda"), "kernel='cuda'")):
        with pytest.raises(ValueError, match=word.replace("(", r"\(").replace(")", r"\)")):
            O.OffloadedAdamW(ps, **kw)
    with pytest.raises(ValueError, match="step=0"):
        O.adamw_step_(torch.ones(2), torch.ones(2), torch.zeros(2), torch.zeros(2), 0, **HP)
    with pytest.raises(ValueError, match="exp_avg has shape"):
        O.adamw_step_(torch.ones(2), torch.ones(2), torch.zeros(3), torch.zeros(2), 1, **HP)
    with pytest.raises(ValueError, match="float32"):
        O.adamw_step_flat_(torch.ones(2, dtype=torch.float64), torch.ones(2), torch.zeros(2), torch.zeros(2), 1, **HP)
    with pytest.raises(ValueError, match="chunk=0"):
        O.adamw_step_flat_(torch.ones(2), torch.ones(2), torch.zeros(2), torch.zeros(2), 1, chunk=0, **HP)
    with pytest.raises(ValueError, match="recipe='sgd'"):
        O.device_host_bytes(10, "sgd")
    with pytest.raises(ValueError, match="recipe='sgd'"):
        O.predict_device_bytes(nn.Linear(2, 2), "sgd")
    with pytest.raises(ValueError, match="kernel='fast'"):
        O.load_kernel("fast")


def test_device_host_bytes():
    assert O.device_host_bytes(10, "mixed-adamw") == {"device": 160, "host": 0}
    assert O.device_host_bytes(10, "offload-adamw") == {"device": 40, "host": 160}
    assert O.device_host_bytes(10, "offload-adamw-grads") == {"device": 20, "host": 160}


def test_install_grad_hooks_accumulates_and_frees():
    ref, mine = _mlp(torch.bfloat16), _mlp(torch.bfloat16)
    slots = [torch.zeros(p.shape) for p in mine.parameters()]
    handles = O.install_grad_hooks(mine.parameters(), slots)
    for x, y in _batches(2, dtype=torch.bfloat16):
        _loss(ref, x, y).backward()
        _loss(mine, x, y).backward()
        assert all(p.grad is None for p in mine.parameters())
    for p, s in zip(ref.parameters(), slots):
        assert s.dtype == torch.float32 and torch.allclose(s, p.grad.float(), rtol=2e-2, atol=1e-3)
    for h in handles:
        h.remove()


# ----------------------------------------------------------------------------- layer streaming
@pytest.mark.parametrize("prefetch", [True, False])
def test_streamed_layers_equal_resident_model(prefetch):
    from memlab.models import TinyGPT, TinyGPTConfig

    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig(n_layer=3, n_embd=32, n_head=2, block_size=16, vocab_size=64)).eval()
    blocks = model.blocks if hasattr(model, "blocks") else model.transformer.h
    x = torch.randn(2, 16, 32)
    with torch.no_grad():
        want = x
        for b in blocks:
            want = b(want)
    streamed = O.StreamedSequential(copy.deepcopy(list(blocks)), device="cpu", prefetch=prefetch)
    got = streamed(x)
    assert torch.equal(got, want)
    assert streamed.max_resident_layers == (2 if prefetch else 1)


# ----------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("step_in_backward", [False, True])
@pytest.mark.parametrize("offload_gradients", [False, True])
def test_cuda_offloaded_bf16_matches_cpu_reference(offload_gradients, step_in_backward):
    ref, mine = _mlp(torch.bfloat16), _mlp(torch.bfloat16, device="cuda")
    masters = [nn.Parameter(p.detach().float()) for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=1e-2, foreach=False)
    opt = O.OffloadedAdamW(mine.parameters(), lr=1e-2, offload_gradients=offload_gradients, kernel="exact",
                           accumulation_steps=2, step_in_backward=step_in_backward)
    assert opt.state[next(mine.parameters())]["master"].is_pinned()
    for x, y in _batches(4, dtype=torch.bfloat16):
        opt.zero_grad()
        for _ in range(2):  # two micro-batches: accumulation on the device or on the host
            _loss(mine, x.cuda(), y.cuda()).backward()
        opt.step()
        # the reference steps on the very gradients the GPU produced
        for i, mp in enumerate(masters):
            mp.grad = opt._flats[0]["grad"].views[i].clone()
        ref_opt.step()
        torch.cuda.synchronize()
        for mp, q in zip(masters, mine.parameters()):
            assert torch.equal(mp.data.to(torch.bfloat16), q.cpu())
    if offload_gradients:
        assert all(p.grad is None for p in mine.parameters())
    n = len(list(mine.parameters()))
    assert opt.traffic["to_host_copies"] == 4 * n * (2 if offload_gradients else 1)  # 4 steps of 2 micro-batches


@pytest.mark.cuda
def test_cuda_streamed_layers_equal_resident():
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(4)]
    x = torch.randn(8, 64, device="cuda")
    resident = nn.Sequential(*copy.deepcopy(layers)).cuda()
    with torch.no_grad():
        want = resident(x)
    got = O.StreamedSequential(layers, device="cuda")(x)
    assert got.device.type == "cuda" and torch.allclose(got, want, rtol=0, atol=0)


@pytest.mark.cuda
def test_cuda_fast_kernel_trains_like_on_device_adamw():
    ref, mine = _mlp(device="cuda"), _mlp(device="cuda")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = O.OffloadedAdamW(mine.parameters(), lr=1e-2)
    for x, y in _batches(5, device="cuda"):
        for m, o in ((ref, ref_opt), (mine, opt)):
            o.zero_grad()
            _loss(m, x, y).backward()
            o.step()
    torch.cuda.synchronize()
    for p, q in zip(ref.parameters(), mine.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- state hygiene (issue 20)
def _train(model, opt, batches, accumulation=1, scaler=None):
    for k in range(0, len(batches), accumulation):
        opt.zero_grad()
        for x, y in batches[k:k + accumulation]:
            loss = _loss(model, x, y) / accumulation
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("offload_gradients", [False, True])
def test_copies_of_the_optimizer_keep_training(how, offload_gradients):
    import io
    import pickle

    model = _mlp()
    opt = O.OffloadedAdamW(model.parameters(), lr=1e-2, offload_gradients=offload_gradients, accumulation_steps=2)
    batches = _batches(8)
    _train(model, opt, batches[:4], accumulation=2)
    if how == "deepcopy":
        model2, opt2 = copy.deepcopy((model, opt))
    else:
        buf = io.BytesIO()
        pickle.dump((model, opt), buf)
        model2, opt2 = pickle.loads(buf.getvalue())
    st = opt2.state[next(model2.parameters())]
    assert st["master"].untyped_storage().data_ptr() == opt2._flats[0]["master"].flat.untyped_storage().data_ptr()
    _train(model, opt, batches[4:], accumulation=2)
    _train(model2, opt2, batches[4:], accumulation=2)  # raised AttributeError before (the copy had no _flats)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    assert opt2.traffic["to_host_copies"] > 0  # the copy's hooks are its own


@pytest.mark.parametrize("offload_gradients", [False, True])
def test_state_dict_round_trip_then_steps_is_bitwise_uninterrupted(offload_gradients):
    import io

    batches = _batches(12)
    model = _mlp()
    opt = O.OffloadedAdamW(model.parameters(), lr=1e-2, offload_gradients=offload_gradients, accumulation_steps=3)
    _train(model, opt, batches, accumulation=3)
    model2 = _mlp()
    opt2 = O.OffloadedAdamW(model2.parameters(), lr=1e-2, offload_gradients=offload_gradients, accumulation_steps=3)
    _train(model2, opt2, batches[:6], accumulation=3)
    buf = io.BytesIO()
    torch.save({"model": model2.state_dict(), "opt": opt2.state_dict()}, buf)
    saved = torch.load(io.BytesIO(buf.getvalue()))
    model3 = _mlp()
    model3.load_state_dict(saved["model"])
    opt3 = O.OffloadedAdamW(model3.parameters(), lr=5.0, offload_gradients=offload_gradients, accumulation_steps=3)
    opt3.load_state_dict(saved["opt"])
    _train(model3, opt3, batches[6:], accumulation=3)
    for p, q in zip(model.parameters(), model3.parameters()):
        assert torch.equal(p, q)


def _inf_batches(n, bad):
    out = _batches(n)
    x, y = out[bad]
    out[bad] = (x, torch.full_like(y, float("inf")))  # an inf loss: inf/NaN gradients, the step is skipped
    return out


@pytest.mark.parametrize("scaler_kind", ["torch", "memlab"])
@pytest.mark.parametrize("offload_gradients", [False, True])
def test_loss_scaler_bitwise_vs_torch_adamw_with_gradscaler(scaler_kind, offload_gradients, one_thread):
    from memlab.amp import DynamicLossScaler

    def make_scaler():
        kw = dict(init_scale=2.0**10, growth_interval=2)
        return torch.amp.GradScaler("cpu", **kw) if scaler_kind == "torch" else DynamicLossScaler(**kw)

    batches = _inf_batches(12, bad=4)
    ref, mine, ref_kw = _pair("exact")
    ref_scaler, scaler = make_scaler(), make_scaler()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, **ref_kw)
    opt = O.OffloadedAdamW(mine.parameters(), lr=1e-2, kernel="exact", offload_gradients=offload_gradients,
                           accumulation_steps=2, grad_scaler=scaler if offload_gradients else None)
    _train(ref, ref_opt, batches, accumulation=2, scaler=ref_scaler)
    _train(mine, opt, batches, accumulation=2, scaler=scaler)
    assert scaler.get_scale() == ref_scaler.get_scale() < 2.0**10 * 4  # backed off once, grew since
    for p, q in zip(ref.parameters(), mine.parameters()):
        assert torch.equal(p, q)


def test_offloaded_gradients_under_a_scaler_without_grad_scaler_say_why():
    model = _mlp()
    scaler = torch.amp.GradScaler("cpu")
    opt = O.OffloadedAdamW(model.parameters(), offload_gradients=True)
    x, y = _batches(1)[0]
    scaler.scale(_loss(model, x, y)).backward()
    with pytest.raises(RuntimeError, match="grad_scaler=scaler"):
        scaler.step(opt)
    with pytest.raises(ValueError, match="step_in_backward"):
        O.OffloadedAdamW(model.parameters(), step_in_backward=True, grad_scaler=scaler)


# ----------------------------------------------------------------------------- what crosses, and when
@pytest.mark.parametrize("step_in_backward", [False, True])
@pytest.mark.parametrize("offload_gradients", [False, True])
def test_gradients_cross_once_per_step_unless_offloaded(offload_gradients, step_in_backward):
    model = _mlp(torch.bfloat16)
    model[0].requires_grad_(False)  # a frozen layer moves nothing
    trainable = [p for p in model.parameters() if p.requires_grad]
    nbytes = sum(p.numel() * p.element_size() for p in trainable)
    k = 4
    opt = O.OffloadedAdamW(model.parameters(), lr=1e-2, offload_gradients=offload_gradients, accumulation_steps=k,
                           step_in_backward=step_in_backward)
    _train(model, opt, _batches(2 * k, dtype=torch.bfloat16), accumulation=k)
    if step_in_backward:  # the hook sent each gradient after the last micro-batch, not before
        grads = [e for e in opt.timeline if e[0] == "grad"]
        assert len(grads) == k * len(trainable)
    per = k if offload_gradients else 1
    assert opt.traffic == {"to_host_bytes": 2 * per * nbytes, "to_host_copies": 2 * per * len(trainable),
                           "to_device_bytes": 2 * nbytes, "to_device_copies": 2 * len(trainable)}


@pytest.mark.parametrize("kernel", ["exact", "fast"])
@pytest.mark.parametrize("offload_gradients", [False, True])
def test_step_in_backward_bitwise_and_updates_start_before_backward_ends(kernel, offload_gradients, one_thread):
    import time

    ref, mine, ref_kw = _pair(kernel)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, **ref_kw)
    opt = O.OffloadedAdamW(mine.parameters(), lr=1e-2, kernel=kernel, offload_gradients=offload_gradients,
                           accumulation_steps=3, step_in_backward=True)
    ends = []

    def slow(grad):  # the first layer's backward takes a while (as a big first layer would)
        time.sleep(0.05)
        ends.append(time.perf_counter())
        return grad

    mine[0].register_forward_hook(lambda mod, inp, out: out.register_hook(slow) and None)
    batches = _batches(9, model=mine)
    _train(ref, ref_opt, batches, accumulation=3)
    for k in range(0, 9, 3):
        opt.zero_grad()
        for x, y in batches[k:k + 3]:
            (_loss(mine, x, y) / 3).backward()
        backward_end = time.perf_counter()
        opt.step()  # waits for the updates still running
        tl = opt.timeline
        starts = [t for e, _, _, t in tl if e == "update_start"]
        grads = [(i, t) for e, _, i, t in tl if e == "grad"]
        assert len(starts) == len(list(mine.parameters()))
        assert min(starts) < ends[-1] < backward_end  # the first update ran while the first layer's backward slept
        last = [i for i, _ in grads[-len(starts):]]  # arrival order of the last micro-batch
        order = [i for e, _, i, _ in tl if e == "update_start"]
        assert order == last  # updates in arrival order
    for p, q in zip(ref.parameters(), mine.parameters()):
        assert torch.equal(p, q)
    with pytest.raises(RuntimeError, match="step_in_backward"):
        opt.clip_grad_norm_(1.0)


@pytest.mark.parametrize("offload_gradients", [False, True])
def test_scaler_unscale_then_clip_bitwise_vs_torch(offload_gradients, one_thread):
    """scaler.unscale_(opt); clip; scaler.step(opt): the clipped, unscaled host grads are the ones stepped."""
    batches = _inf_batches(8, bad=2)
    ref, mine, ref_kw = _pair("exact")
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, **ref_kw)
    opt = O.OffloadedAdamW(mine.parameters(), lr=1e-2, kernel="exact", offload_gradients=offload_gradients,
                           accumulation_steps=2, grad_scaler=scaler if offload_gradients else None)
    for k in range(0, 8, 2):
        for m, o, sc in ((ref, ref_opt, ref_scaler), (mine, opt, scaler)):
            o.zero_grad()
            for x, y in batches[k:k + 2]:
                sc.scale(_loss(m, x, y) / 2).backward()
            sc.unscale_(o)
            if o is opt:
                got = opt.clip_grad_norm_(0.05)
            else:
                want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, foreach=False)
            sc.step(o)
            sc.update()
        assert torch.equal(got, want) or (not torch.isfinite(want) and not torch.isfinite(got))
        for p, q in zip(ref.parameters(), mine.parameters()):
            assert torch.equal(p, q)
    assert scaler.get_scale() == ref_scaler.get_scale()


@pytest.mark.parametrize("kernel", ["exact", "fast"])
@pytest.mark.parametrize("offload_gradients", [False, True])
def test_delay_update_is_adamw_on_one_step_old_weights(kernel, offload_gradients, one_thread):
    """delay_update=True: step t's gradient is computed on the weights of update t-1, bitwise."""
    ref, mine, ref_kw = _pair(kernel)
    lag = copy.deepcopy(ref)  # the weights the device computes with
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, **ref_kw)
    opt = O.OffloadedAdamW(mine.parameters(), lr=1e-2, kernel=kernel, offload_gradients=offload_gradients,
                           accumulation_steps=2, delay_update=True)
    batches = _batches(10, model=mine)
    for k in range(0, 10, 2):
        lag.zero_grad()
        opt.zero_grad()
        for x, y in batches[k:k + 2]:
            (_loss(lag, x, y) / 2).backward()
            (_loss(mine, x, y) / 2).backward()
        for p, q in zip(ref.parameters(), lag.parameters()):
            p.grad = q.grad.clone()
        with torch.no_grad():
            for p, q in zip(ref.parameters(), lag.parameters()):
                q.copy_(p)  # the device receives the previous update now
        ref_opt.step()
        opt.step()  # returns while the CPU steps
        for p, q in zip(lag.parameters(), mine.parameters()):
            assert torch.equal(p, q)
    opt.flush()
    for p, q in zip(ref.parameters(), mine.parameters()):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="pick one"):
        O.OffloadedAdamW(mine.parameters(), step_in_backward=True, delay_update=True)


# ----------------------------------------------------------------------------- the lecture's on-page Streamed
LECTURE_04 = pathlib.Path(__file__).resolve().parents[2] / "notebooks" / "04_cpu_offload_adam.ipynb"


def _lecture_streamed(notebook=LECTURE_04):
    """The lecture's on-page ``Streamed``: the one code cell that defines it, run in a namespace with torch."""
    import json

    cells = json.loads(pathlib.Path(notebook).read_text())["cells"]
    found = ["".join(c["source"]) for c in cells if c["cell_type"] == "code" and "class Streamed(" in "".join(c["source"])]
    assert len(found) == 1, f"{len(found)} cells of {notebook} define Streamed"
    namespace = {"torch": torch, "nn": nn}
    exec(compile(found[0], f"{notebook.name}:Streamed", "exec"), namespace)
    return namespace["Streamed"]


class _FakeStream:
    def __init__(self, name):
        self.name = name

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass


class _FakeEvent:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


def test_lecture_streamed_records_the_compute_stream_on_each_prefetched_weight(monkeypatch):
    """CPU, fake CUDA streams: the lecture's ``Streamed`` runs its CUDA branch, with ``.to(device)`` inside the
    side stream's context making a new tensor (the device copy) and ``record_stream`` recorded. Every tensor
    made on the side stream and read by a layer on the compute stream must get ``record_stream(compute)``
    while it is alive: without it the caching allocator may give its memory to the next prefetch while the
    compute stream still reads it (memlab's StreamedSequential does it; the lecture's copy did not)."""
    import contextlib

    compute, active, made, recorded = _FakeStream("compute"), [], {}, {}

    @contextlib.contextmanager
    def stream(s):
        active.append(s)
        try:
            yield
        finally:
            active.pop()

    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if active:  # a host -> device copy issued on the side stream: a new tensor, as on CUDA
            copy_ = self.clone()
            made[id(copy_)] = copy_
            return copy_
        return real_to(self, *args, **kwargs)

    def record_stream(self, s):
        recorded.setdefault(id(self), []).append(s.name)

    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: _FakeStream("side"))
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: active[-1] if active else compute)
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)

    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4)]
    x = torch.randn(2, 8)
    with torch.no_grad():
        want = nn.Sequential(*copy.deepcopy(layers))(x)
    got = _lecture_streamed()(layers, "cuda")(x)  # "cuda": the streamed branch (the fakes stand in for CUDA)
    assert torch.equal(got, want)
    assert len(made) == 2 * len(layers)  # a weight and a bias per layer, each copied once on the side stream
    missing = [tuple(t.shape) for i, t in made.items() if "compute" not in recorded.get(i, [])]
    assert not missing, (f"{len(missing)} of {len(made)} weights copied on the side stream and read on the compute "
                         f"stream without record_stream(compute): {missing}")


@pytest.mark.cuda
def test_cuda_lecture_streamed_equals_resident_while_the_compute_stream_lags():
    """The lecture's ``Streamed`` on CUDA, each layer's kernels queued behind a sleep on the compute stream so
    that the side stream's prefetches run ahead: a weight block freed without record_stream can be reused by a
    later prefetch before the layer that reads it has run. The output must equal the resident model's."""
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(6)]
    x = torch.randn(64, 256, device="cuda")
    with torch.no_grad():
        want = nn.Sequential(*copy.deepcopy(layers)).cuda()(x)
    streamed = _lecture_streamed()(copy.deepcopy(layers), "cuda")
    for layer in streamed.layers:  # the compute stream falls behind the copies
        layer.register_forward_pre_hook(lambda m, a: torch.cuda._sleep(20_000_000))
    for _ in range(3):
        got = streamed(x)
        torch.cuda.synchronize()
        assert torch.equal(got, want)


def test_bench_speed_times_both_thread_counts_on_the_same_work_in_flipping_order(monkeypatch):
    # `memlab bench speed`'s AdamW figure: every count steps the same buffers with the same step number; the
    # order of the counts flips every round (the first round untimed); the caller's thread count is kept
    from memlab.bench import speed

    calls = []

    def fake(p, g, m, v, step, **hp):
        calls.append((torch.get_num_threads(), p.data_ptr(), g.data_ptr(), step, tuple(sorted(hp.items()))))

    monkeypatch.setattr(O, "adamw_step_eager_chunked_", fake)
    before = torch.get_num_threads()
    med = speed.chunked_adamw_rounds(1000, 3, (1, 2))
    assert [c[0] for c in calls] == [2, 1, 1, 2, 2, 1, 1, 2]
    assert len({c[1:] for c in calls}) == 1  # one work for every call
    assert set(med) == {1, 2} and all(t > 0 and c >= 0 for t, c in med.values())
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_eager_step_helpers_run_under_the_callers_grad_mode(mode, monkeypatch, all_workers):
    # grad mode is per thread: a helper in the default mode would refuse an in-place op on a view made under
    # no_grad of a tensor that requires grad (or on an inference tensor), and leave the step half done
    import threading

    from memlab.offload import kernel as K

    monkeypatch.setattr(K, "MIN_PER_WORKER", 1000)
    real, on_helper = K._step_chunk, threading.Event()

    def spy(*a, **kw):
        if threading.current_thread() is not threading.main_thread():
            on_helper.set()
        else:
            on_helper.wait(5)  # let a helper claim a slice
        return real(*a, **kw)

    monkeypatch.setattr(K, "_step_chunk", spy)
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    torch.manual_seed(0)
    with ctx():
        p = torch.randn(20_000, requires_grad=mode == "no_grad") if mode == "no_grad" else torch.randn(20_000)
        g, m, v = torch.randn(20_000), torch.zeros(20_000), torch.zeros(20_000)
        ref = [t.detach().clone() for t in (p, g, m, v)]
        O.adamw_step_eager_chunked_(p, g, m, v, 1, chunk=1000, threads=2, **HP)
        O.adamw_step_eager_chunked_(*ref, 1, chunk=1000, threads=1, **HP)
    assert on_helper.is_set()
    assert torch.equal(p.detach(), ref[0]) and torch.equal(m, ref[2]) and torch.equal(v, ref[3])


def test_bench_offload_no_cpu_needs_cuda_and_reports_each_gpu_recipe_as_it_ends(monkeypatch, capsys):
    # --no-cpu skips the CPU tables (a short GPU lease); with nothing left to run it says so. On CUDA each recipe's
    # figures reach stderr as soon as measured, so a bench stopped at a time limit still leaves them.
    from memlab.bench import offload

    with pytest.raises(SystemExit):
        offload.main(["--no-cpu"])
    assert "--no-cpu with no CUDA device leaves nothing to run" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        offload.main(["--no-cpu", "--no-gpu"])
    assert "--no-cpu with --no-gpu" in capsys.readouterr().err

    import memlab.config as config

    monkeypatch.setattr(config, "DEVICE", torch.device("cuda"))
    monkeypatch.setattr(offload, "GPU_RECIPES", (offload.BASELINE, "memlab OffloadedAdamW"))
    seen = []

    def fake(recipe, **kw):
        seen.append(recipe)
        assert not capsys.readouterr().out  # no CPU table printed first
        return {"params": 10, "peak": 100 if recipe == offload.BASELINE else 40, "seconds": 1.0}

    monkeypatch.setattr(offload, "gpu_recipe", fake)
    monkeypatch.setattr(offload, "_gpu_table", lambda results, args, checks: None)
    assert offload.main(["--no-cpu"]) == 0
    err = capsys.readouterr().err
    assert seen == [offload.BASELINE, "memlab OffloadedAdamW"]
    assert "bench offload memlab OffloadedAdamW: 1.000 s/step, peak 40 B" in err
