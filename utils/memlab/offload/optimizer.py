"""CPU-offload AdamW from scratch (ZeRO-Offload), and layer streaming for inference.

AdamW (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization", Algorithm 2) keeps two
fp32 moments per parameter. With bias corrections ``bc1 = 1 - beta1**t`` and
``bc2 = 1 - beta2**t`` one step is::

    p <- p * (1 - lr * wd)                       (decoupled weight decay)
    m <- m + (1 - beta1) * (g - m)               (= beta1*m + (1-beta1)*g, torch's lerp)
    v <- beta2 * v + (1 - beta2) * g * g
    p <- p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)

In mixed-precision training the model states take 16 bytes per parameter (2 weights + 2 grads
+ 4 fp32 master + 8 moments), and 12 of them belong only to the optimizer step. ZeRO-Offload
(Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX ATC) moves
those 12 to host memory: gradients stream to the host during backward, the step runs on the CPU,
and the updated 16-bit weights are copied back. The device keeps 2 bytes (weights) + 2 bytes
(gradients, or none with ``offload_gradients=True``) per parameter. The host holds 16 bytes per
parameter here (4 master + 4 fp32 gradient slot + 8 moments), plus a 2-byte pinned staging copy
per 16-bit parameter on CUDA: 18.

What is here, each checked in tests/test_offload.py:

* :func:`adamw_step_`: the update on tensors with torch ops in the order of torch's
  single-tensor AdamW (``torch/optim/adam.py``, ``_single_tensor_adam``), so N steps are
  ``torch.equal`` to ``torch.optim.AdamW(foreach=False)``.
* :func:`pack` / :class:`FlatBuffer`: parameters packed in one flat contiguous fp32 buffer with a
  view per parameter.
* :func:`adamw_step_flat_`: the fast CPU step on flat buffers, one pass over memory in
  cache-sized chunks. The kernel is a ~40-line C++/OpenMP loop (:data:`KERNEL_SOURCE`) compiled
  with the system ``g++`` into ``~/.cache/memlab`` and called through ``ctypes`` (a build takes
  about a second; ``torch.utils.cpp_extension.load_inline`` measured 38 s on a 2-core machine
  because it compiles torch's headers, and the kernel needs only pointers). Without a compiler
  it falls back to an eager chunked torch implementation; :func:`kernel_name` says which runs.
  Both round like the vectorised loop of torch's fused CPU AdamW (fused multiply-add in ``lerp``
  and ``addcmul``, a correctly rounded square root) and are bitwise equal to
  ``torch.optim.AdamW(fused=True)`` wherever torch runs that loop (torch's fused kernel finishes
  each thread's range with a scalar loop that rounds a little differently). They differ from
  :func:`adamw_step_` by at most a few units in the last place, because torch's element-wise
  ``sqrt`` on CPU (MKL's vector math library on x86 builds) is not correctly rounded.
* :class:`OffloadedAdamW`: a ``torch.optim.Optimizer`` with host fp32 master weights and moments.
* :class:`StreamedSequential`: inference with layers kept on the host and streamed to the device
  one at a time, prefetching the next.
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import os
import queue
import shutil
import subprocess
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from torch import nn

__all__ = [
    "adamw_step_",
    "bias_corrections",
    "FlatBuffer",
    "pack",
    "adamw_step_flat_",
    "adamw_step_eager_chunked_",
    "kernel_name",
    "load_kernel",
    "KERNEL_SOURCE",
    "DEFAULT_CHUNK",
    "OffloadedAdamW",
    "StreamedSequential",
    "device_host_bytes",
    "predict_device_bytes",
    "install_grad_hooks",
]

DEFAULT_CHUNK = 16384  # floats: 4 arrays x 64 KiB = 256 KiB in flight, about an L2 cache


# ----------------------------------------------------------------------------- argument checks
def _check_hparams(lr: Any, beta1: Any, beta2: Any, eps: Any, weight_decay: Any) -> None:
    def num(name: str, v: Any) -> float:
        if isinstance(v, torch.Tensor) or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{name}={v!r} must be a Python float")
        if not math.isfinite(v):
            raise ValueError(f"{name}={v!r} must be finite")
        return float(v)

    if num("lr", lr) < 0:
        raise ValueError(f"lr={lr!r} must be >= 0")
    for name, b in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= num(name, b) < 1.0:
            raise ValueError(f"{name}={b!r} must be in [0, 1)")
    if num("eps", eps) <= 0:
        raise ValueError(f"eps={eps!r} must be > 0")
    if num("weight_decay", weight_decay) < 0:
        raise ValueError(f"weight_decay={weight_decay!r} must be >= 0")


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step={step!r} must be an int >= 1 (the number of this update, counting from 1)")
    return step


def bias_corrections(step: int, beta1: float, beta2: float) -> tuple[float, float]:
    """``(1 - beta1**step, 1 - beta2**step)`` in Python floats (double), as torch computes them."""
    _check_step(step)
    return 1 - beta1**step, 1 - beta2**step


# ----------------------------------------------------------------------------- the update rule
def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW update in place on ``param``, ``exp_avg`` and ``exp_avg_sq``.

    ``step`` is the number of this update (1 for the first). The ops and their order are those of
    torch's single-tensor AdamW, so the results are bitwise equal to ``torch.optim.AdamW(foreach=False)``.
    """
    _check_hparams(lr, beta1, beta2, eps, weight_decay)
    _check_step(step)
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if not isinstance(t, torch.Tensor) or t.shape != param.shape:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} has shape {got}; it must have param's shape {tuple(param.shape)}")
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bc1, bc2 = bias_corrections(step, beta1, beta2)
    step_size = lr / bc1
    denom = (exp_avg_sq.sqrt() / bc2**0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


# ----------------------------------------------------------------------------- flat buffers
class FlatBuffer:
    """One flat contiguous buffer holding several tensors, with a view shaped like each.

    ``offsets[i]`` is where tensor ``i`` starts; ``views[i]`` shares the buffer's storage, so
    writing a view writes the buffer and one kernel call over ``flat`` updates every tensor.
    """

    def __init__(self, shapes: Sequence[torch.Size | tuple[int, ...]], *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", pin_memory: bool = False) -> None:
        self.shapes = [torch.Size(s) for s in shapes]
        self.numels = [s.numel() for s in self.shapes]
        self.offsets = [0]
        for n in self.numels:
            self.offsets.append(self.offsets[-1] + n)
        total = self.offsets[-1]
        self.flat = torch.zeros(total, dtype=dtype, device=device, pin_memory=pin_memory)
        self.views = [self.flat[o:o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def __len__(self) -> int:
        return len(self.views)

    # pickle copies each tensor's storage separately: keep only ``flat`` and cut the views again
    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "views"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.views = [self.flat[o:o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def segment(self, i: int) -> torch.Tensor:
        """The flat 1-D slice of tensor ``i``."""
        return self.flat[self.offsets[i]:self.offsets[i + 1]]


def pack(tensors: Sequence[torch.Tensor], *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
         pin_memory: bool = False) -> FlatBuffer:
    """A :class:`FlatBuffer` holding copies of ``tensors`` (cast to ``dtype``), in order."""
    tensors = list(tensors)
    buf = FlatBuffer([t.shape for t in tensors], dtype=dtype, device=device, pin_memory=pin_memory)
    with torch.no_grad():
        for v, t in zip(buf.views, tensors):
            v.copy_(t.detach())
    return buf


# ----------------------------------------------------------------------------- the fast CPU kernel
KERNEL_SOURCE = r"""
// AdamW over flat fp32 arrays, one pass in chunks, parallel over chunks with OpenMP.
// Roundings follow torch's CPU kernels: lerp and addcmul use a fused multiply-add.
#include <cmath>
#include <cstdint>
#include <algorithm>
#ifdef _OPENMP
#include <omp.h>
#endif
extern "C" void memlab_adamw(float* p, const float* g, float* m, float* v, int64_t n, int64_t chunk,
                             int threads, int decay_on, float decay, float w1, int small_w1,
                             float beta2, float w2, float neg_step, float bc2_sqrt, float eps) {
  const int64_t nchunks = (n + chunk - 1) / chunk;
#ifdef _OPENMP
  #pragma omp parallel for schedule(static) num_threads(threads)
#endif
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t lo = c * chunk, hi = std::min(n, lo + chunk);
    const float w1m1 = w1 - 1.0f;
    #pragma omp simd
    for (int64_t i = lo; i < hi; ++i) {
      const float gi = g[i];
      float pi = p[i];
      if (decay_on) pi = pi * decay;
      const float mi0 = m[i];
      // torch lerp: weight < 0.5 ? self + w*(end-self) : end - (end-self)*(1-w), as an fma
      const float mi = small_w1 ? std::fma(w1, gi - mi0, mi0) : std::fma(w1m1, gi - mi0, gi);
      const float vi = std::fma(w2 * gi, gi, v[i] * beta2);   // mul_(beta2).addcmul_(g, g, 1-beta2)
      const float denom = std::sqrt(vi) / bc2_sqrt + eps;
      p[i] = pi + (neg_step * mi) / denom;                      // addcdiv_(m, denom, -step_size)
      m[i] = mi;
      v[i] = vi;
    }
  }
}
"""

_KERNEL: Any = None
_KERNEL_NAME: str | None = None


def _compile(cache: Path) -> Any:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    flags = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"]
    key = hashlib.sha256((KERNEL_SOURCE + " ".join(flags) + cxx).encode()).hexdigest()[:16]
    so = cache / f"memlab_adamw_{key}.so"
    if not so.exists():
        cache.mkdir(parents=True, exist_ok=True)
        src = cache / f"memlab_adamw_{key}.{os.getpid()}.cpp"  # per process: parallel test workers may build at once
        src.write_text(KERNEL_SOURCE)
        tmp = cache / f"memlab_adamw_{key}.{os.getpid()}.so"
        try:
            subprocess.run([cxx, *flags, str(src), "-o", str(tmp)], check=True, capture_output=True, timeout=120)
            os.replace(tmp, so)  # atomic: a reader sees no library or a whole one
        finally:
            src.unlink(missing_ok=True)
    lib = ctypes.CDLL(str(so))
    fn = lib.memlab_adamw
    fp, i64, ci, cf = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    fn.argtypes = [fp, fp, fp, fp, i64, i64, ci, ci, cf, cf, ci, cf, cf, cf, cf, cf]
    fn.restype = None
    return fn


def load_kernel(force: str | None = None) -> str:
    """Compile (once, cached in ``~/.cache/memlab``) and load the C++ kernel; return the kernel's name.

    ``force`` (or the environment variable ``MEMLAB_OFFLOAD_KERNEL``) picks ``"cpp"`` or ``"eager"``;
    by default the C++ kernel is used when it builds, else the eager chunked torch fallback.
    """
    global _KERNEL, _KERNEL_NAME
    choice = (force or os.environ.get("MEMLAB_OFFLOAD_KERNEL", "auto")).strip().lower()
    if choice not in ("auto", "cpp", "eager"):
        raise ValueError(f"kernel={choice!r} is not known; allowed: 'auto', 'cpp', 'eager'")
    if choice == "eager":
        _KERNEL, _KERNEL_NAME = None, "eager chunked torch"
        return _KERNEL_NAME
    if _KERNEL is not None:
        return _KERNEL_NAME  # type: ignore[return-value]
    cache = Path(os.environ.get("MEMLAB_CACHE", Path.home() / ".cache" / "memlab"))
    try:
        _KERNEL = _compile(cache)
        _KERNEL_NAME = "C++/OpenMP (g++ -O3 -march=native)"
    except Exception as exc:  # no compiler, no OpenMP, read-only cache ...
        if choice == "cpp":
            raise RuntimeError(f"the C++ AdamW kernel did not build: {exc}") from exc
        _KERNEL, _KERNEL_NAME = None, f"eager chunked torch (C++ kernel unavailable: {type(exc).__name__})"
    return _KERNEL_NAME


def kernel_name() -> str:
    """Which fast-step implementation :func:`adamw_step_flat_` runs."""
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


def adamw_step_eager_chunked_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                              step: int, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                              chunk: int = DEFAULT_CHUNK) -> None:
    """The fallback fast step: the update with torch ops on cache-sized slices of flat buffers.

    One difference from :func:`adamw_step_`: the square root is correctly rounded (computed in
    float64, then rounded to float32), as in the C++ kernel and torch's fused CPU AdamW. torch's
    element-wise ``sqrt`` on CPU goes through the vector math library (MKL VML on x86 builds) and
    is off by one unit in the last place for about 1 value in 6, which is why
    ``AdamW(fused=True)`` and ``AdamW(foreach=False)`` do not agree bitwise on a CPU.
    """
    _check_hparams(lr, beta1, beta2, eps, weight_decay)
    _check_step(step)
    _check_flat(param, grad, exp_avg, exp_avg_sq)
    bc1, bc2 = bias_corrections(step, beta1, beta2)
    step_size, bc2_sqrt = lr / bc1, bc2**0.5
    p, g, m, v = (t.view(-1) for t in (param, grad, exp_avg, exp_avg_sq))
    for lo in range(0, p.numel(), chunk):
        pc, gc, mc, vc = (t[lo:lo + chunk] for t in (p, g, m, v))
        if weight_decay != 0:
            pc.mul_(1 - lr * weight_decay)
        mc.lerp_(gc, 1 - beta1)
        vc.mul_(beta2).addcmul_(gc, gc, value=1 - beta2)
        denom = vc.double().sqrt_().float().div_(bc2_sqrt).add_(eps)
        pc.addcdiv_(mc, denom, value=-step_size)


def adamw_step_flat_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                     step: int, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                     chunk: int = DEFAULT_CHUNK, threads: int | None = None) -> None:
    """The fast CPU AdamW step on contiguous fp32 tensors (flat buffers), rounding like torch's fused CPU AdamW.

    Memory-bound: it reads p, g, m, v and writes p, m, v, 28 bytes per parameter.
    """
    _check_hparams(lr, beta1, beta2, eps, weight_decay)
    _check_step(step)
    _check_flat(param, grad, exp_avg, exp_avg_sq)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r} must be an int >= 1 (elements per chunk)")
    kernel_name()
    if _KERNEL is None:
        adamw_step_eager_chunked_(param, grad, exp_avg, exp_avg_sq, step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                  weight_decay=weight_decay, chunk=chunk)
        return
    bc1, bc2 = bias_corrections(step, beta1, beta2)
    w1 = 1 - beta1
    _KERNEL(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), param.numel(), chunk,
            int(threads or torch.get_num_threads()), int(weight_decay != 0), 1 - lr * weight_decay, w1,
            int(abs(w1) < 0.5), beta2, 1 - beta2, -(lr / bc1), bc2**0.5, eps)


# ----------------------------------------------------------------------------- the optimizer
class OffloadedAdamW(torch.optim.Optimizer):
    """AdamW with fp32 master weights and moments in host memory and the step on the CPU (ZeRO-Offload).

    Host (pinned when the parameters are on CUDA), per param group, flat fp32 buffers with a view
    per parameter: ``master``, ``grad``, ``exp_avg``, ``exp_avg_sq``. Device: the model's
    parameters in their own dtype, and their gradients unless ``offload_gradients=True``.

    What crosses between device and host, per optimizer step of ``accumulation_steps`` micro-batches:

    * gradients, device to host, in the parameters' dtype: once per step (after the last
      micro-batch; the earlier ones accumulate in ``p.grad`` on the device), or every micro-batch
      with ``offload_gradients=True`` (the device gradient is freed at once and the micro-batches
      are summed on the host in fp32);
    * updated weights, host to device, in the parameters' dtype (cast on the host), once per step.

    :attr:`traffic` counts both (bytes and copies) since construction.

    * ``overlap=True``: a post-accumulate-grad hook sends each gradient to the host as soon as
      backward has finished it, on a side CUDA stream, so backward goes on meanwhile.
    * ``step_in_backward=True`` (needs ``overlap``): a worker thread updates each parameter on the
      CPU as soon as its gradient has arrived, in arrival order, while backward computes the rest;
      :meth:`step` only waits for the last updates. The parameters change during backward, before
      anything could look at all the gradients together: no gradient clipping and no loss scaler
      with it (both raise, saying why).
    * :meth:`step` (without ``step_in_backward``) steps every parameter on the CPU after backward.
    * ``delay_update=True``: DeepSpeed's one-step delayed parameter update (ZeRO-Offload paper, sec.
      4.2): :meth:`step` hands this step's update to the worker thread and returns; the device runs
      the next step's forward and backward on the weights it has while the CPU steps, and the
      result reaches the device at the next :meth:`step` (call :meth:`flush` after the last one).
      Every gradient is then computed on weights one update old: a different trajectory, traded for
      a CPU step that hides behind a whole step instead of the tail of backward. A second fp32
      gradient buffer (4 host bytes per parameter) holds the step's gradients while the hooks fill
      the other.
    * A loss scaler (``torch.amp.GradScaler`` or :class:`memlab.amp.DynamicLossScaler`) works:
      the optimizer unscales the host gradients itself and skips the step on inf/NaN. With
      ``offload_gradients=True`` the scaler finds no ``.grad`` on the device, so pass it as
      ``grad_scaler=`` for the optimizer to report its inf check back to it.
    * :meth:`clip_grad_norm_` clips the host gradients like ``torch.nn.utils.clip_grad_norm_``.

    ``kernel="fast"`` (default) steps with :func:`adamw_step_flat_`, which rounds like torch's
    fused CPU AdamW; ``kernel="exact"`` steps each parameter with :func:`adamw_step_`, so that
    with fp32 parameters on a CPU the trajectory is bitwise that of
    ``torch.optim.AdamW(foreach=False)`` (about 7x slower). On a CPU-only machine host == device
    and the same code runs; there the one gradient copy per step is made in :meth:`step` (nothing
    to hide behind backward) unless ``step_in_backward`` needs it from the hook.
    """

    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale / found_inf and lets step() decide

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, pin_memory: bool | None = None,
                 overlap: bool = True, offload_gradients: bool = False, kernel: str = "fast",
                 accumulation_steps: int = 1, step_in_backward: bool = False, grad_scaler: Any = None,
                 delay_update: bool = False) -> None:
        if kernel not in ("fast", "exact"):
            raise ValueError(f"kernel={kernel!r} is not known; allowed: 'fast' (C++ flat step), 'exact' (torch's for-loop order)")
        self.kernel = kernel
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas={betas!r} must be a pair (beta1, beta2)")
        _check_hparams(lr, betas[0], betas[1], eps, weight_decay)
        for name, flag in (("overlap", overlap), ("offload_gradients", offload_gradients),
                           ("step_in_backward", step_in_backward), ("delay_update", delay_update)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name}={flag!r} must be True or False")
        if pin_memory is not None and not isinstance(pin_memory, bool):
            raise ValueError(f"pin_memory={pin_memory!r} must be None (pin when CUDA is present), True or False")
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps={accumulation_steps!r} must be an int >= 1 (micro-batches per step)")
        if step_in_backward and not (overlap or offload_gradients):
            raise ValueError("step_in_backward=True needs overlap=True: the update starts from the gradient hook")
        if step_in_backward and delay_update:
            raise ValueError("step_in_backward=True and delay_update=True: pick one way to overlap the CPU update "
                             "(during this backward, or during the next step's forward and backward)")
        if step_in_backward and grad_scaler is not None:
            raise ValueError("step_in_backward=True with grad_scaler: each parameter is updated during backward, before "
                             "the scaler could check every gradient for inf/NaN; use step_in_backward=False with a scaler")
        if grad_scaler is not None and not hasattr(grad_scaler, "_per_optimizer_states"):
            raise ValueError(f"grad_scaler={type(grad_scaler).__name__}: allowed: torch.amp.GradScaler or "
                             "memlab.amp.DynamicLossScaler")
        self.overlap, self.offload_gradients = overlap, offload_gradients
        self.accumulation_steps, self.step_in_backward = accumulation_steps, step_in_backward
        self.grad_scaler = grad_scaler
        self.delay_update = delay_update
        self._delayed: list[tuple[int, int]] = []  # (group, index): updated on the host, not yet copied back
        self._pin_arg = pin_memory
        self._flats: list[dict[str, Any]] = []
        self._hooks: list[Any] = []
        self._device: torch.device | None = None
        self._d2h_stream: Any = None
        self._h2d_stream: Any = None
        self._h2d_event: Any = None
        self._reset_runtime()
        self.traffic = {"to_host_bytes": 0, "to_host_copies": 0, "to_device_bytes": 0, "to_device_copies": 0}
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def _reset_runtime(self) -> None:
        """Per-parameter bookkeeping, keyed by parameter (rebuilt after deepcopy / unpickling)."""
        self._slot: dict[torch.Tensor, tuple[int, int]] = {}  # param -> (group index, index in group)
        self._ready: dict[torch.Tensor, int] = {}  # micro-batches summed in the host slot (0: none)
        self._count: dict[torch.Tensor, int] = {}  # backward passes that finished p's gradient this step
        self._pending: dict[torch.Tensor, Any] = {}  # CUDA event of a grad copy still in flight
        self._stepped: dict[torch.Tensor, bool] = {}  # updated by the worker during this backward
        self._copied: dict[torch.Tensor, tuple[int, int]] = {}  # (id, _version) of the p.grad last sent to the host
        self._unscaled_found: torch.Tensor | None = None  # host grads already unscaled (clip under a scaler)
        self._lock = threading.Lock()
        self._queue: Any = None
        self._worker: Any = None
        self._worker_error: BaseException | None = None
        self._cycle_open = False
        self.timeline: list[tuple[str, int, int, float]] = []  # (event, group, index, perf_counter) this step

    # -- set-up
    @property
    def cuda(self) -> bool:
        return self._device is not None and self._device.type == "cuda"

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hparams(group["lr"], group["betas"][0], group["betas"][1], group["eps"], group["weight_decay"])
        params = group["params"]
        for p in params:
            if not p.is_floating_point():
                raise ValueError(f"a parameter of dtype {p.dtype}: OffloadedAdamW needs floating-point parameters")
            if self._device is None:
                self._device = p.device
            elif p.device != self._device:
                raise ValueError(f"parameters on {self._device} and {p.device}: put them all on one device")
        pin = self._pin_arg if self._pin_arg is not None else (self.cuda and torch.cuda.is_available())
        bufs: dict[str, Any] = {
            "master": pack(params, pin_memory=pin),
            "grad": FlatBuffer([p.shape for p in params], pin_memory=pin),
            "exp_avg": FlatBuffer([p.shape for p in params], pin_memory=pin),
            "exp_avg_sq": FlatBuffer([p.shape for p in params], pin_memory=pin),
        }
        if self.cuda:
            # pinned staging in each parameter's own dtype: grads arrive here, updated weights leave from here
            bufs["staging"] = [torch.empty(p.shape, dtype=p.dtype, pin_memory=pin) for p in params]
        self._flats.append(bufs)
        for i, p in enumerate(params):
            st = self.state[p]
            st["step"] = torch.tensor(0.0)
            st["exp_avg"] = bufs["exp_avg"].views[i]
            st["exp_avg_sq"] = bufs["exp_avg_sq"].views[i]
            st["master"] = bufs["master"].views[i]
        self._attach(len(self._flats) - 1)

    def _attach(self, gi: int) -> None:
        """Bookkeeping, streams and gradient hooks for param group ``gi``."""
        if self.cuda and self._d2h_stream is None:
            self._d2h_stream = torch.cuda.Stream(device=self._device)
            self._h2d_stream = torch.cuda.Stream(device=self._device)
        for i, p in enumerate(self.param_groups[gi]["params"]):
            self._slot[p] = (gi, i)
            self._ready[p] = 0
            self._count[p] = 0
            self._pending[p] = None
            self._stepped[p] = False
            if p.requires_grad and (self.overlap or self.offload_gradients):
                self._hooks.append(p.register_post_accumulate_grad_hook(_make_hook(self)))

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the parameters (the optimizer then gathers grads in step())."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # -- copies: pickling and deepcopy keep the buffers and rebuild hooks, streams and the worker
    def __getstate__(self) -> dict[str, Any]:
        self._drain()
        skip = {"_hooks", "_slot", "_ready", "_count", "_pending", "_stepped", "_copied", "_unscaled_found", "_lock",
                "_queue", "_worker",
                "_worker_error", "_d2h_stream", "_h2d_stream", "_h2d_event", "_cycle_open", "timeline"}
        return {k: v for k, v in self.__dict__.items() if k not in skip}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._hooks = []
        self._d2h_stream = self._h2d_stream = self._h2d_event = None
        self._reset_runtime()
        for gi, bufs in enumerate(self._flats):
            for i, p in enumerate(self.param_groups[gi]["params"]):
                for k in ("master", "exp_avg", "exp_avg_sq"):
                    self.state[p][k] = bufs[k].views[i]  # the state is the buffers' views again (pickle split them)
            self._attach(gi)

    # -- gradients to the host
    def _log(self, what: str, p: torch.Tensor) -> None:
        gi, i = self._slot[p]
        self.timeline.append((what, gi, i, time.perf_counter()))

    def _count_copy(self, direction: str, t: torch.Tensor) -> None:
        with self._lock:
            self.traffic[f"{direction}_bytes"] += t.numel() * t.element_size()
            self.traffic[f"{direction}_copies"] += 1

    def _on_grad(self, p: torch.Tensor) -> None:
        """The post-accumulate-grad hook: send ``p.grad`` to the host when it is final for this step."""
        if p.grad is None:
            return
        if not self._cycle_open:
            self.timeline = []
            self._cycle_open = True
        self._count[p] += 1
        self._log("grad", p)
        if self.offload_gradients:
            self._to_host(p)  # every micro-batch: the device keeps no gradient
        elif self._count[p] == self.accumulation_steps:
            if not self.cuda and not self.step_in_backward:
                return  # host == device: nothing to hide, step() makes the one copy (the tracker sees it there)
            self._to_host(p)  # the last micro-batch: the sum autograd accumulated on the device
        elif self._count[p] > self.accumulation_steps:
            self._ready[p], self._pending[p] = 0, None  # more micro-batches than declared: step() copies again
            return
        else:
            return
        if self.step_in_backward and self._count[p] == self.accumulation_steps:
            self._start_worker()
            self._queue.put(p)

    def _to_host(self, p: torch.Tensor) -> None:
        """Copy (or, with offload_gradients, add) ``p.grad`` into its fp32 host slot; free it if offloading."""
        gi, i = self._slot[p]
        grad = p.grad
        self._count_copy("to_host", grad)
        self._copied[p] = (id(grad), grad._version)
        if not self.cuda:
            slot = self._flats[gi]["grad"].views[i]
            if self._ready[p] and self.offload_gradients:
                slot.add_(grad)
            else:
                slot.copy_(grad)
            self._ready[p] += 1
        else:
            if self.offload_gradients:
                self._fold(p)  # an earlier micro-batch's copy joins the fp32 host slot first
            stream = self._d2h_stream
            stream.wait_stream(torch.cuda.current_stream(p.device))
            staging = self._flats[gi]["staging"][i]
            with torch.cuda.stream(stream):
                staging.copy_(grad, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            grad.record_stream(stream)  # the caching allocator must not hand grad's memory out before the copy ran
            self._pending[p] = event
        if self.offload_gradients:
            p.grad = None

    def _fold(self, p: torch.Tensor) -> None:
        """Wait for ``p``'s grad copy and add it to (or write it into) the fp32 host slot."""
        event = self._pending[p]
        if event is None:
            return
        event.synchronize()
        gi, i = self._slot[p]
        slot = self._flats[gi]["grad"].views[i]
        staging = self._flats[gi]["staging"][i]
        if self._ready[p] and self.offload_gradients:
            slot.add_(staging)
        else:
            slot.copy_(staging)
        self._ready[p] += 1
        self._pending[p] = None

    def _gather(self, p: torch.Tensor) -> bool:
        """Make ``p``'s host gradient ready; False when ``p`` has no gradient this step.

        Without offloaded gradients ``p.grad`` stays the truth: if it changed in place since a
        hook sent it (a loss scaler's ``unscale_``, another micro-batch), it is sent again.
        """
        if self._pending.get(p) is not None:
            self._fold(p)
        if not self.offload_gradients and p.grad is None:
            return False  # the gradient stays on the device: none there (or set to None since), no update, like torch
        if p.grad is not None and not self.offload_gradients and (
                not self._ready[p] or self._copied.get(p) != (id(p.grad), p.grad._version)):
            gi, i = self._slot[p]
            self._count_copy("to_host", p.grad)
            self._copied[p] = (id(p.grad), p.grad._version)
            self._flats[gi]["grad"].views[i].copy_(p.grad)  # synchronous: no hook sent it, or it went stale
            self._ready[p] = 1
        return bool(self._ready[p])

    # -- the update, one parameter (worker thread) or a whole group
    def _hp(self, group: dict[str, Any]) -> dict[str, float]:
        beta1, beta2 = group["betas"]
        return dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])

    def _update_one(self, p: torch.Tensor, grad: FlatBuffer | None = None, copy_back: bool = True) -> None:
        gi, i = self._slot[p]
        bufs = self._flats[gi]
        grad = grad if grad is not None else bufs["grad"]
        st = self.state[p]
        st["step"] += 1
        update = adamw_step_flat_ if self.kernel == "fast" else adamw_step_
        update(bufs["master"].views[i], grad.views[i], bufs["exp_avg"].views[i], bufs["exp_avg_sq"].views[i],
               int(st["step"].item()), **self._hp(self.param_groups[gi]))
        if copy_back:
            self._copy_back(p, gi, i)

    def _apply(self, todo: list[tuple[int, list[int]]], grads: list[FlatBuffer], copy_back: bool) -> None:
        """Step the parameters ``todo`` lists, group by group, from the gradient buffers ``grads``."""
        for (gi, idx), grad in zip(todo, grads):
            group = self.param_groups[gi]
            params = group["params"]
            bufs = self._flats[gi]
            steps = {int(self.state[params[i]]["step"].item()) for i in idx}
            if not self.cuda and self.kernel == "fast" and len(idx) == len(params) and len(steps) == 1 and idx:
                # CPU, every grad on the host: one fast call over the whole group
                for p in params:
                    self.state[p]["step"] += 1
                adamw_step_flat_(bufs["master"].flat, grad.flat, bufs["exp_avg"].flat, bufs["exp_avg_sq"].flat,
                                 steps.pop() + 1, **self._hp(group))
                if copy_back:
                    for i in idx:
                        self._copy_back(params[i], gi, i)
            else:
                for i in idx:
                    self._update_one(params[i], grad, copy_back)

    def _start_worker(self) -> None:
        if self._worker is not None and self._worker.is_alive():
            return
        self._queue = queue.Queue()
        self._worker = threading.Thread(target=self._work, args=(self._queue,), name="OffloadedAdamW-step", daemon=True)
        self._worker.start()

    def _work(self, q: Any) -> None:
        while True:
            p = q.get()
            try:
                if p is None:
                    return
                if callable(p):  # delay_update: a whole step's update
                    if self._worker_error is None:
                        with torch.no_grad():
                            p()
                elif self._worker_error is None:
                    self._fold(p)
                    self._log("update_start", p)
                    with torch.no_grad():
                        self._update_one(p)
                    self._log("update_end", p)
                    self._stepped[p] = True
            except BaseException as exc:  # reported by step()
                self._worker_error = exc
            finally:
                q.task_done()

    def _drain(self) -> None:
        """Wait until the worker has finished every update it was given."""
        if self._queue is not None:
            self._queue.join()
        if self._worker_error is not None:
            exc, self._worker_error = self._worker_error, None
            raise RuntimeError(f"OffloadedAdamW: a parameter update in the worker thread failed: {exc!r}") from exc

    # -- clipping
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the host gradients so their global norm is at most ``max_norm``; return the norm before.

        Same arithmetic as ``torch.nn.utils.clip_grad_norm_(foreach=False)``: the norm of the
        per-tensor norms, then ``g *= min(1, max_norm / (total + 1e-6))``.
        """
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
            raise ValueError(f"max_norm={max_norm!r} must be a number > 0")
        if norm_type != 2.0:
            raise ValueError(f"norm_type={norm_type!r} is not supported; allowed: 2.0")
        if self.step_in_backward:
            raise RuntimeError("clip_grad_norm_ with step_in_backward=True: the parameters were already updated during "
                               "backward, before the global norm of all gradients was known; use step_in_backward=False")
        grads = []
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if self._gather(p):
                    grads.append(self._flats[gi]["grad"].views[i])
        if self.offload_gradients and self.grad_scaler is not None and self._unscaled_found is None:
            # the scaler's unscale_ found no .grad on the device: the host grads are still scaled
            self._unscaled_found = self._unscale_host(grads)
        if not grads:
            return torch.tensor(0.0)
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads]), 2.0)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
        return total

    # -- loss scaling
    def _unscale_host(self, host_grads: list[torch.Tensor]) -> torch.Tensor:
        """Offloaded gradients under the attached scaler: unscale the host grads, report the inf check to the scaler."""
        scale = self.grad_scaler._scale
        found = torch.zeros((), dtype=torch.float32)
        if scale is not None and host_grads:
            inv = scale.double().reciprocal().float().cpu()
            torch._amp_foreach_non_finite_check_and_unscale_(host_grads, found, inv)
        dev = scale.device if scale is not None else torch.device("cpu")
        self.grad_scaler._per_optimizer_states[id(self)]["found_inf_per_device"] = {dev: found.to(dev)}
        return found

    def _unscale(self, host_grads: list[torch.Tensor]) -> bool:
        """Under a loss scaler: unscale the host gradients in place; True when the step must be skipped."""
        scaler_found = getattr(self, "found_inf", 0)
        if self.offload_gradients:
            if self.grad_scaler is None:
                raise RuntimeError(
                    "OffloadedAdamW(offload_gradients=True) under a loss scaler: the gradients left the device during "
                    "backward, so the scaler finds no .grad to check for inf/NaN and its update() would fail ('No inf "
                    "checks were recorded'). Pass the scaler to the optimizer: OffloadedAdamW(..., grad_scaler=scaler)")
            if self._unscaled_found is None:  # the host grads are still scaled whatever the scaler's stage says
                self._unscaled_found = self._unscale_host(host_grads)
            return bool(self._unscaled_found.item())
        grad_scale = getattr(self, "grad_scale", None)
        found = torch.zeros((), dtype=torch.float32)
        if grad_scale is not None and host_grads:
            inv = grad_scale.double().reciprocal().float().cpu()
            torch._amp_foreach_non_finite_check_and_unscale_(host_grads, found, inv)
        return bool(found.item()) or bool(float(scaler_found))

    # -- the step
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scaled = hasattr(self, "found_inf")  # a GradScaler / DynamicLossScaler is calling us
        if self.step_in_backward:
            self._drain()
            if scaled:
                raise RuntimeError("OffloadedAdamW(step_in_backward=True) under a loss scaler: each parameter was "
                                   "updated during backward with its still-scaled gradient, before the scaler could "
                                   "check for inf/NaN; use step_in_backward=False with a scaler")
            wrong = {self._count[p] for g in self.param_groups for p in g["params"] if self._stepped[p]} - {self.accumulation_steps}
            if wrong:
                raise RuntimeError(f"OffloadedAdamW(step_in_backward=True, accumulation_steps={self.accumulation_steps}): "
                                   f"a parameter got {sorted(wrong)} backward passes this step; the update ran after "
                                   f"micro-batch {self.accumulation_steps}, so call step() after exactly that many")
        if self.delay_update:
            self._copy_back_delayed()  # the previous step's update, computed during this step's forward/backward
        if self._h2d_event is not None:
            self._h2d_event.synchronize()  # last step's copies have left the staging buffers
        todo: list[tuple[int, list[int]]] = []
        host_grads = []
        for gi, group in enumerate(self.param_groups):
            idx = []
            for i, p in enumerate(group["params"]):
                if self._stepped[p]:
                    continue
                if self._gather(p):
                    idx.append(i)
                    host_grads.append(self._flats[gi]["grad"].views[i])
            todo.append((gi, idx))
        if scaled and self._unscale(host_grads):
            self._end_cycle()  # inf/NaN: skip the update, as GradScaler does
            return loss
        if not self.delay_update:
            self._apply(todo, [self._flats[gi]["grad"] for gi, _ in todo], copy_back=True)
        else:
            # one-step delayed update: the CPU steps on this step's gradients while the device runs the next
            # step's forward and backward on the weights it has; the result reaches the device at the next step()
            grads = []
            for gi, _ in todo:
                bufs = self._flats[gi]
                if "grad_next" not in bufs:
                    bufs["grad_next"] = FlatBuffer(bufs["grad"].shapes, pin_memory=bufs["grad"].flat.is_pinned())
                bufs["grad"], bufs["grad_next"] = bufs["grad_next"], bufs["grad"]  # the hooks fill the other one
                grads.append(bufs["grad_next"])
            self._delayed = [(gi, i) for gi, idx in todo for i in idx]
            self._start_worker()
            self._queue.put(lambda: self._apply(todo, grads, copy_back=False))
        if self.cuda:
            self._h2d_event = torch.cuda.Event()
            self._h2d_event.record(self._h2d_stream)
            torch.cuda.current_stream(self._device).wait_stream(self._h2d_stream)  # the next forward reads the weights
        self._end_cycle()
        return loss

    def _copy_back_delayed(self) -> None:
        self._drain()
        if self.cuda and self._delayed:
            self._h2d_stream.wait_stream(torch.cuda.current_stream(self._device))  # backward has read the old weights
        for gi, i in self._delayed:
            self._copy_back(self.param_groups[gi]["params"][i], gi, i)
        self._delayed = []

    def extra_state_tensors(self) -> list[torch.Tensor]:
        """The host buffers kept outside ``self.state``: the fp32 gradient slots (two with
        ``delay_update``) and, on CUDA, the pinned staging copies. ``memlab.profiler.MemoryTracker``
        counts them as optimizer memory (they are made with the optimizer, before any tracked step)."""
        out: list[torch.Tensor] = []
        for bufs in self._flats:
            out += [bufs[k].flat for k in ("grad", "grad_next") if k in bufs]
            out += list(bufs.get("staging", []))
        return out

    @torch.no_grad()
    def flush(self) -> None:
        """``delay_update=True``: wait for the update still running and copy its weights to the model (end of training)."""
        self._copy_back_delayed()
        if self.cuda:
            torch.cuda.current_stream(self._device).wait_stream(self._h2d_stream)

    def _end_cycle(self) -> None:
        self._unscaled_found = None
        for p in self._ready:
            self._ready[p] = 0
            self._count[p] = 0
            self._stepped[p] = False
            self._pending[p] = None
        self._cycle_open = False

    def _copy_back(self, p: torch.Tensor, gi: int, i: int) -> None:
        master = self._flats[gi]["master"].views[i]
        self._count_copy("to_device", p)
        if not self.cuda:
            p.data.copy_(master)  # cast to p's dtype (round to nearest even)
            return
        staging = self._flats[gi]["staging"][i]
        src = master
        if p.dtype != torch.float32:
            staging.copy_(master)  # cast on the host: half the bytes cross PCIe
            src = staging
        with torch.cuda.stream(self._h2d_stream):
            p.data.copy_(src, non_blocking=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.step_in_backward:
            self._drain()  # (a delayed update keeps running: it reads its own gradient buffer)
        super().zero_grad(set_to_none=set_to_none)
        self._end_cycle()

    # -- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Like torch's: ``{"state": {index: {step, exp_avg, exp_avg_sq, master}}, "param_groups": [...]}``.

        The tensors are the live host views (as torch returns live tensors); ``copy.deepcopy`` or
        ``torch.save`` them to keep a snapshot.
        """
        self._drain()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore hyper-parameters, steps, moments and master weights (and copy the masters to the model)."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("state_dict must be a dict with 'state' and 'param_groups' (from OffloadedAdamW.state_dict())")
        self._drain()
        self._delayed = []  # the masters below replace whatever update was in flight
        saved = state_dict["state"]
        views = {id(p): {k: self.state[p][k] for k in ("exp_avg", "exp_avg_sq", "master")}
                 for g in self.param_groups for p in g["params"]}
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        index = 0
        with torch.no_grad():
            for gi, group in enumerate(self.param_groups):
                for i, p in enumerate(group["params"]):
                    st = self.state[p]
                    st.update(views[id(p)])
                    src = saved.get(index, saved.get(str(index), {}))
                    st["step"] = torch.tensor(float(src["step"])) if "step" in src else torch.tensor(0.0)
                    for k in ("exp_avg", "exp_avg_sq", "master"):
                        if k in src:
                            st[k].copy_(src[k])
                    if "master" in src:
                        p.data.copy_(st["master"])
                    index += 1


def _make_hook(opt: OffloadedAdamW):
    ref = weakref.ref(opt)

    def hook(p: torch.Tensor) -> None:
        o = ref()
        if o is not None:
            o._on_grad(p)

    return hook


# ----------------------------------------------------------------------------- memory accounting
# bytes per parameter (device, host) of weights + grads + optimizer state; activations not counted
OFFLOAD_RECIPES: dict[str, tuple[int, int]] = {
    "fp32-adamw": (16, 0),  # 4 weights + 4 grads + 8 moments, all on the device
    "mixed-adamw": (16, 0),  # 2 weights + 2 grads + 4 fp32 master + 8 moments, all on the device
    "offload-adamw": (4, 16),  # device: 2 + 2; host: 4 master + 4 fp32 grad slot + 8 moments
    "offload-adamw-grads": (2, 16),  # gradients leave the device during backward
}


def device_host_bytes(n_params: int, recipe: str) -> dict[str, int]:
    """Device and host bytes of weights + grads + optimizer state for ``n_params`` 16-bit-trained parameters.

    Recipes: ``fp32-adamw`` and ``mixed-adamw`` (16 bytes/param on the device), ``offload-adamw``
    (4 on the device, 16 on the host), ``offload-adamw-grads`` (2 on the device). Activations
    and the pinned staging buffers (2 host bytes per 16-bit parameter on CUDA) are not counted.
    """
    if isinstance(n_params, bool) or not isinstance(n_params, int) or n_params < 0:
        raise ValueError(f"n_params={n_params!r} must be an int >= 0")
    if recipe not in OFFLOAD_RECIPES:
        raise ValueError(f"recipe={recipe!r} is not known; allowed: {', '.join(OFFLOAD_RECIPES)}")
    dev, host = OFFLOAD_RECIPES[recipe]
    return {"device": dev * n_params, "host": host * n_params}


DEVICE_RECIPES = ("adamw", "offload", "offload grads")


def predict_device_bytes(model: nn.Module, recipe: str) -> int:
    """Device bytes of ``model``'s parameters, buffers, gradients and optimizer state after a step.

    ``"adamw"``: torch AdamW on the model as it is (weights, grads and two moments in the
    parameters' dtype); ``"offload"``: OffloadedAdamW (weights and grads stay, states leave);
    ``"offload grads"``: OffloadedAdamW with ``offload_gradients=True`` (only the weights stay).
    Tied parameters count once. The scalar step counters (4 bytes per tensor) are left out.
    """
    if recipe not in DEVICE_RECIPES:
        raise ValueError(f"recipe={recipe!r} is not known; allowed: {', '.join(DEVICE_RECIPES)}")
    params = list({id(p): p for p in model.parameters()}.values())
    weights = sum(p.numel() * p.element_size() for p in params)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    trained = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    per = {"adamw": 3, "offload": 1, "offload grads": 0}[recipe]
    return weights + buffers + per * trained


def install_grad_hooks(params: Iterable[torch.Tensor], slots: Sequence[torch.Tensor]) -> list[Any]:
    """Stage gradients as backward produces them: add each finished ``p.grad`` into its fp32 slot, then free it.

    ``slots[i]`` is parameter ``i``'s host buffer (same shape, float32). Uses
    ``Tensor.register_post_accumulate_grad_hook``, which fires once ``p.grad`` holds the whole
    gradient of this backward; setting ``p.grad = None`` there releases the device memory at
    once, so the device never holds all gradients together. Returns the hook handles.
    """
    params = list(params)
    slots = list(slots)
    if len(params) != len(slots):
        raise ValueError(f"{len(params)} params but {len(slots)} slots; give one slot per parameter")
    handles = []
    for p, slot in zip(params, slots):
        if slot.shape != p.shape or slot.dtype != torch.float32:
            raise ValueError(f"slot of shape {tuple(slot.shape)} and dtype {slot.dtype} for a parameter of shape "
                             f"{tuple(p.shape)}: slots must be float32 with the parameter's shape")

        def hook(param: torch.Tensor, slot: torch.Tensor = slot) -> None:
            slot.add_(param.grad)  # float32 += grad (cast up on the fly)
            param.grad = None

        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(hook))
    return handles


# ----------------------------------------------------------------------------- layer streaming
class StreamedSequential(nn.Module):
    """Inference through ``layers`` whose weights live on the host, streamed to ``device`` one layer at a time.

    While layer ``k`` computes, layer ``k+1``'s weights are already being copied on a side CUDA
    stream (prefetch), so the device holds at most two layers' weights. The idea behind
    accelerate's ``device_map`` with offloaded modules. On CPU host == device and the copies
    are plain clones, so the same code runs (and is tested) everywhere.
    """

    def __init__(self, layers: Sequence[nn.Module], device: torch.device | str | None = None, *,
                 prefetch: bool = True, pin_memory: bool | None = None) -> None:
        super().__init__()
        layers = list(layers)
        if not layers or not all(isinstance(m, nn.Module) for m in layers):
            raise ValueError(f"layers must be a non-empty sequence of nn.Module, got {[type(m).__name__ for m in layers]}")
        self.layers = nn.ModuleList(layers)
        self.device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r} is CUDA but torch.cuda.is_available() is False")
        self.prefetch = prefetch
        pin = pin_memory if pin_memory is not None else self.device.type == "cuda"
        self._host: list[list[torch.Tensor]] = []
        with torch.no_grad():
            for m in self.layers:
                tensors = []
                for t in self._tensors(m):
                    h = t.data.to("cpu")
                    if pin:
                        h = h.pin_memory()
                    t.data = h
                    tensors.append(h)
                self._host.append(tensors)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.max_resident_layers = 0

    @staticmethod
    def _tensors(m: nn.Module) -> list[torch.Tensor]:
        return list(m.parameters()) + list(m.buffers())

    def _fetch(self, k: int) -> tuple[list[torch.Tensor], Any]:
        """Start copying layer ``k`` to the device; return the device tensors and an event (CUDA)."""
        if self._stream is None:
            return [h.to(self.device, copy=True) for h in self._host[k]], None
        with torch.cuda.stream(self._stream):
            dev = [h.to(self.device, non_blocking=True) for h in self._host[k]]
            ev = torch.cuda.Event()
            ev.record(self._stream)
        return dev, ev

    @torch.no_grad()
    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        n = len(self.layers)
        nxt = self._fetch(0)
        resident = 0
        for k, layer in enumerate(self.layers):
            dev, ev = nxt
            if ev is not None:
                torch.cuda.current_stream(self.device).wait_event(ev)
                for t in dev:
                    t.record_stream(torch.cuda.current_stream(self.device))
            if self.prefetch and k + 1 < n:
                nxt = self._fetch(k + 1)
                resident = 2
            else:
                resident = max(resident, 1)
            tensors = self._tensors(layer)
            for t, d in zip(tensors, dev):
                t.data = d
            out = layer(x, *args, **kwargs)
            x = out[0] if isinstance(out, tuple) else out
            for t, h in zip(tensors, self._host[k]):
                t.data = h
            del dev
            if not self.prefetch and k + 1 < n:
                nxt = self._fetch(k + 1)
            self.max_resident_layers = max(self.max_resident_layers, resident)
        return x
