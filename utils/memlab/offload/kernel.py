"""The fast CPU AdamW step on flat fp32 buffers: a C++/OpenMP loop built with g++ and called through ctypes.

The kernel (``adamw.cpp`` beside this file) makes one pass over memory in cache-sized chunks and
rounds like the vectorised loop of torch's fused CPU AdamW (a fused multiply-add in ``lerp`` and
``addcmul``, a correctly rounded square root). It is compiled once with the system ``g++`` into
``~/.cache/memlab`` by :mod:`memlab.core.native` (``torch.utils.cpp_extension.load_inline`` would compile
torch's headers; the kernel needs only pointers). Without a compiler an eager chunked torch step rounds the same way.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from memlab.core.native import NATIVE_FLAGS, build_library, cache_folder
from memlab.core.validation import check_choice, check_positive_int
from memlab.offload.update import bias_corrections, check_hparams

__all__ = ["KERNEL_PATH", "KERNEL_SOURCE", "DEFAULT_CHUNK", "EAGER_CHUNK", "load_kernel", "kernel_name",
           "adamw_step_flat_", "adamw_step_eager_chunked_", "intra_op_threads"]

DEFAULT_CHUNK = 16384  # floats: 4 arrays x 64 KiB = 256 KiB in flight, about an L2 cache

#: the C++ source, shipped as package data next to this module
KERNEL_PATH = Path(__file__).with_name("adamw.cpp")
KERNEL_SOURCE = KERNEL_PATH.read_text()

_KERNEL: Any = None
_KERNEL_NAME: str | None = None
_FLAGS = list(NATIVE_FLAGS)


def _compile(cache: Path) -> Any:
    # Build ``adamw.cpp`` into ``cache`` (once per source, flags and compiler: memlab.core.native) and load it.
    fn = build_library(KERNEL_PATH, "adamw", _FLAGS, cache).memlab_adamw
    fp, i64, ci, cf = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    fn.argtypes = [fp, fp, fp, fp, i64, i64, ci, ci, cf, cf, ci, cf, cf, cf, cf, cf]
    fn.restype = None
    return fn


def load_kernel(force: str | None = None) -> str:
    """Compile (once, cached in ``~/.cache/memlab`` or ``$MEMLAB_CACHE``) and load the C++ kernel;
    return the name of the kernel :func:`adamw_step_flat_` now runs.

    Args:
        force: ``"cpp"``, ``"eager"`` or ``"auto"``; None reads the environment variable
            ``MEMLAB_OFFLOAD_KERNEL`` (default ``"auto"``: the C++ kernel when it builds, else the
            eager chunked torch fallback).

    Raises:
        ValueError: an unknown choice.
        RuntimeError: ``"cpp"`` was forced and the kernel did not build.
    """
    global _KERNEL, _KERNEL_NAME
    choice = check_choice("kernel", (force or os.environ.get("MEMLAB_OFFLOAD_KERNEL", "auto")).strip().lower(),
                          ("auto", "cpp", "eager"))
    if choice == "eager":
        _KERNEL, _KERNEL_NAME = None, "eager chunked torch"
        return _KERNEL_NAME
    if _KERNEL is not None:
        return _KERNEL_NAME  # type: ignore[return-value]
    try:
        _KERNEL = _compile(cache_folder())
        _KERNEL_NAME = "C++/OpenMP (g++ -O3 -march=native)"
    except Exception as exc:  # no compiler, no OpenMP, read-only cache ...
        if choice == "cpp":
            raise RuntimeError(f"the C++ AdamW kernel did not build: {exc}") from exc
        _KERNEL, _KERNEL_NAME = None, f"eager chunked torch (C++ kernel unavailable: {type(exc).__name__})"
    return _KERNEL_NAME


def kernel_name() -> str:
    """Which fast-step implementation :func:`adamw_step_flat_` runs, ``"C++/OpenMP ..."`` or
    ``"eager chunked torch ..."`` (loading it on first call)."""
    return _KERNEL_NAME if _KERNEL_NAME is not None else load_kernel()


def _check_flat(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} is a {type(t).__name__}; it must be a torch.Tensor")
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name} is {t.dtype} on {t.device} (contiguous={t.is_contiguous()}); "
                             "the flat step needs contiguous float32 CPU tensors")
        if t.numel() != param.numel():
            raise ValueError(f"{name} has {t.numel()} elements; param has {param.numel()}")


#: elements per slice of the eager step when the caller names none. Each op costs about a microsecond
#: beside its arithmetic (Python, the dispatcher, the GIL), so it takes slices 4x the C++ kernel's: 10 ops
#: per 64K elements (measured fastest of 16K-256K on 2 cores), whose arrays and float64 scratch (2.25 MiB)
#: stay in the last-level cache
EAGER_CHUNK = 1 << 16

#: elements a worker thread of the eager chunked step gets at least (a few milliseconds of work): below
#: it, waking a helper thread and waiting for its last chunk costs more than the helper saves
MIN_PER_WORKER = 1 << 20

_THREADS_LOCK = threading.Lock()
_THREADS_HELD = [0, 0]  # [callers inside intra_op_threads, the count to restore when the last leaves]


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count at ``n`` inside the block, the caller's count restored after it.

    For loops of small ops (a cache-sized chunk of an AdamW step): torch splits an op across its
    threads, and on a machine whose cores are busy each split op waits for a thread to be
    scheduled, once per op (chapter 04 measured the chunked step 20-60x slower at two threads than at
    one). Nested and concurrent blocks (a step on a worker thread beside another) share one saved
    count, restored when the last block ends.

    Raises:
        ValueError: ``n`` is not an int >= 1.
    """
    check_positive_int("n", n)
    with _THREADS_LOCK:
        if _THREADS_HELD[0] == 0:
            _THREADS_HELD[1] = torch.get_num_threads()
        _THREADS_HELD[0] += 1
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
    try:
        yield
    finally:
        with _THREADS_LOCK:
            _THREADS_HELD[0] -= 1
            if _THREADS_HELD[0] == 0 and torch.get_num_threads() != _THREADS_HELD[1]:
                torch.set_num_threads(_THREADS_HELD[1])


def _step_chunk(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                scratch: tuple[torch.Tensor, torch.Tensor], consts: tuple[float, ...]) -> None:
    # One slice (views of the flat buffers), 10 in-place ops (9 without weight decay), the temporaries in
    # two scratch buffers of the worker: the square root in float64 of the float32 moment, rounded once to
    # float32 (correctly rounded).
    decay, w1, beta2, w2, neg_step, bc2_sqrt, eps = consts
    wide, narrow = scratch
    if wide.numel() != p.numel():  # the last, shorter slice
        wide, narrow = wide[:p.numel()], narrow[:p.numel()]
    if decay != 1:
        p.mul_(decay)
    m.lerp_(g, w1)
    v.mul_(beta2).addcmul_(g, g, value=w2)
    wide.copy_(v).sqrt_()
    narrow.copy_(wide).div_(bc2_sqrt).add_(eps)
    p.addcdiv_(m, narrow, value=neg_step)


class _EagerStep:
    """One call's slices, claimed one at a time by the calling thread and any helper that runs (a
    dynamic schedule): a helper that is late or never scheduled leaves its share to the others, and the
    caller waits only for slices a helper has already begun. Every thread steps under the caller's grad
    and inference modes (both are per thread in torch)."""

    def __init__(self, bufs: tuple[torch.Tensor, ...], chunk: int, consts: tuple[float, ...]) -> None:
        self.bufs, self.chunk, self.consts = bufs, chunk, consts
        self.modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        self.nchunks = -(-bufs[0].numel() // chunk)
        self.lock = threading.Lock()
        self.claimed = self.done = 0
        self.finished = threading.Event()
        self.errors: list[BaseException] = []
        if self.nchunks == 0:
            self.finished.set()

    def _claim(self) -> int:
        with self.lock:
            i, self.claimed = self.claimed, self.claimed + 1
        return i

    def _release(self) -> None:
        with self.lock:
            self.done += 1
            last = self.done == self.nchunks
        if last:
            self.finished.set()

    def drain(self) -> None:
        """Step unclaimed slices until none is left (errors are kept for the caller)."""
        p, g, m, v = self.bufs
        chunk, scratch = self.chunk, None
        inference = torch.inference_mode() if self.modes[1] else contextlib.nullcontext()
        with inference, torch.set_grad_enabled(self.modes[0]):  # in this order: inference_mode sets grad mode
            while (i := self._claim()) < self.nchunks:
                try:
                    if not self.errors:
                        if scratch is None:  # per worker, once per call: float64 and float32, one slice long
                            k = min(chunk, p.numel())
                            scratch = (torch.empty(k, dtype=torch.float64), torch.empty(k))
                        s = slice(i * chunk, (i + 1) * chunk)
                        _step_chunk(p[s], g[s], m[s], v[s], scratch, self.consts)
                except BaseException as exc:  # re-raised on the calling thread
                    self.errors.append(exc)
                finally:
                    self._release()


class _Helpers:
    """Daemon threads kept from one step to the next, each running the ``drain`` of the jobs it takes
    from one queue; a thread is started only when a step asks for more helpers than there are."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget the threads and the queue (a forked child has neither)."""
        self.lock, self.jobs, self.threads = threading.Lock(), queue.SimpleQueue(), []

    def _run(self) -> None:
        while True:
            self.jobs.get().drain()

    def submit(self, job: _EagerStep, k: int) -> None:
        """Offer ``job`` to ``k`` helpers (it does not wait for any to start)."""
        with self.lock:
            while len(self.threads) < k:
                t = threading.Thread(target=self._run, name=f"memlab-adamw-{len(self.threads) + 1}", daemon=True)
                t.start()
                self.threads.append(t)
        for _ in range(k):
            self.jobs.put(job)


_HELPERS = _Helpers()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_HELPERS.reset)

#: a step that may use helpers runs the worker count it does not prefer once in this many calls, to re-measure it
#: (in a quiet machine that is a 1-worker step, ~1.7x slower on 2 cores: about 4% of the time of 16 steps)
REMEASURE_EVERY = 16


class _WorkerCount:
    """The worker count chosen by measuring: seconds per element of one worker and of ``most``, per size
    class (``n``'s bit length), each the least of its last 3 steps (a busy moment only slows a step) after a
    first, unmeasured one (fresh buffers' page faults, helpers starting); a step runs the faster count, and
    the other once in :data:`REMEASURE_EVERY` calls. Where the machine lends no second core (another
    process holds it, and the OS shares CPU time between sessions, not threads) helpers only add
    switching, and the step falls back to one worker."""

    def __init__(self) -> None:
        self.times: dict[tuple[int, int], collections.deque[float]] = {}
        self.calls: dict[tuple[int, int], int] = {}

    def _rate(self, key: tuple[int, int]) -> float | None:
        seen = self.times.get(key)
        return min(seen) if seen else None

    def pick(self, n: int, most: int) -> int:
        """The worker count for a step of ``n`` elements that may use up to ``most`` (>= 1)."""
        if most == 1:
            return 1
        key = (n.bit_length(), most)
        self.calls[key] = calls = self.calls.get(key, 0) + 1
        one, many = self._rate((key[0], 1)), self._rate(key)
        if many is None or one is None:
            return most if many is None else 1
        best, other = (most, 1) if many <= one else (1, most)
        return other if calls % REMEASURE_EVERY == 0 else best

    def record(self, n: int, workers: int, seconds: float) -> None:
        """Keep one step's time for ``workers`` (not the first step's)."""
        key = (n.bit_length(), workers)
        if key not in self.times:
            self.times[key] = collections.deque(maxlen=3)
        else:
            self.times[key].append(seconds / max(n, 1))


_WORKERS = _WorkerCount()


def adamw_step_eager_chunked_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                              step: int, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                              chunk: int | None = None, threads: int | None = None) -> None:
    """The fallback fast step: the update with torch ops on cache-sized slices of flat buffers.

    One difference from :func:`memlab.offload.adamw_step_`: the square root is correctly rounded
    (computed in float64, then rounded to float32), as in the C++ kernel and torch's fused CPU
    AdamW. torch's element-wise ``sqrt`` on CPU goes through the vector math library (MKL VML on
    x86 builds), which is not correctly rounded: that is why ``AdamW(fused=True)`` and
    ``AdamW(foreach=False)`` do not agree bitwise on a CPU.

    Threads as the C++ kernel uses them, one parallel region over slices, never inside one: with
    torch's intra-op threads held at 1 (:func:`intra_op_threads`), the calling thread and up to
    ``threads - 1`` helper threads (kept between calls; fewer when a worker would get under
    :data:`MIN_PER_WORKER` elements) claim slices one at a time until none is left (torch's ops
    release the GIL while they compute). The step runs with all of them or with the calling thread
    alone, whichever stepped this size faster lately (re-measured once in :data:`REMEASURE_EVERY`
    calls): on a machine whose other cores are busy, helpers would only slow it. Each element is
    stepped once, by the same ops whichever thread steps it: the result does not depend on
    ``threads`` or on ``chunk``.

    The four tensors are contiguous float32 CPU tensors of one size; ``chunk`` is elements per slice
    (None: :data:`EAGER_CHUNK`); ``threads`` None is ``torch.get_num_threads()``.

    Raises:
        ValueError: a bad hyper-parameter, step, chunk or thread count, or a tensor that is not
            contiguous float32 on the CPU.
    """
    check_hparams(lr, beta1, beta2, eps, weight_decay)
    check_positive_int("step", step)
    chunk = EAGER_CHUNK if chunk is None else check_positive_int("chunk", chunk)
    if threads is not None:
        check_positive_int("threads", threads)
    _check_flat(param, grad, exp_avg, exp_avg_sq)
    bc1, bc2 = bias_corrections(step, beta1, beta2)
    n = param.numel()
    workers = max(1, min(threads or torch.get_num_threads(), -(-n // chunk), n // MIN_PER_WORKER))
    consts = (1 - lr * weight_decay if weight_decay != 0 else 1, 1 - beta1, beta2, 1 - beta2, -(lr / bc1),
              bc2**0.5, eps)
    job = _EagerStep(tuple(t.view(-1) for t in (param, grad, exp_avg, exp_avg_sq)), chunk, consts)
    workers = _WORKERS.pick(n, workers)
    with intra_op_threads(1):
        t0 = time.perf_counter()
        if workers > 1:
            _HELPERS.submit(job, workers - 1)
        job.drain()
        job.finished.wait()
        if n:
            _WORKERS.record(n, workers, time.perf_counter() - t0)
    if job.errors:
        raise job.errors[0]


def adamw_step_flat_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                     step: int, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                     chunk: int | None = None, threads: int | None = None) -> None:
    """The fast CPU AdamW step on contiguous fp32 tensors (flat buffers), rounding like torch's fused CPU AdamW.

    Memory-bound: it reads p, g, m, v and writes p, m, v, 28 bytes per parameter.

    Args:
        param, grad, exp_avg, exp_avg_sq: contiguous float32 CPU tensors of one size; param and the
            moments are updated in place.
        chunk: elements per chunk (one OpenMP work item; one slice of the eager fallback); None is
            :data:`DEFAULT_CHUNK` for the C++ kernel, :data:`EAGER_CHUNK` for the eager fallback.
        threads: OpenMP threads (the eager fallback's worker threads); None uses ``torch.get_num_threads()``.

    Raises:
        ValueError: a bad hyper-parameter, step or chunk, or a tensor that is not contiguous float32 on the CPU.
    """
    check_hparams(lr, beta1, beta2, eps, weight_decay)
    check_positive_int("step", step)
    _check_flat(param, grad, exp_avg, exp_avg_sq)
    if chunk is not None:
        check_positive_int("chunk", chunk)
    kernel_name()
    if _KERNEL is None:
        adamw_step_eager_chunked_(param, grad, exp_avg, exp_avg_sq, step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                  weight_decay=weight_decay, chunk=chunk, threads=threads)
        return
    bc1, bc2 = bias_corrections(step, beta1, beta2)
    w1 = 1 - beta1
    # torch's lerp picks its formula by |weight| < 0.5; the kernel gets the choice as a flag
    _KERNEL(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), param.numel(),
            chunk or DEFAULT_CHUNK,
            int(threads or torch.get_num_threads()), int(weight_decay != 0), 1 - lr * weight_decay, w1,
            int(abs(w1) < 0.5), beta2, 1 - beta2, -(lr / bc1), bc2**0.5, eps)
