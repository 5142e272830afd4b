"""CPU-offload AdamW from scratch (ZeRO-Offload), and layer streaming for inference.

AdamW (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization", Algorithm 2) keeps two
fp32 moments per parameter. With bias corrections ``bc1 = 1 - beta1**t`` and
``bc2 = 1 - beta2**t`` one step is::

    p <- p * (1 - lr * wd)                       (decoupled weight decay)
    m <- m + (1 - beta1) * (g - m)               (= beta1*m + (1-beta1)*g, torch's lerp)
    v <- beta2 * v + (1 - beta2) * g * g
    p <- p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)

ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX
ATC) keeps the fp32 master weights and moments in host memory and runs this step on the CPU.

The modules, in the order the chapter builds them:

* :mod:`~memlab.offload.update`: :func:`adamw_step_` (torch's single-tensor op order, bitwise
  equal to ``torch.optim.AdamW(foreach=False)``), :func:`bias_corrections`, :class:`FlatBuffer`
  and :func:`pack` (one contiguous fp32 buffer with a view per parameter);
* :mod:`~memlab.offload.kernel`: :func:`adamw_step_flat_`, the fast CPU step over flat buffers
  (C++/OpenMP from ``adamw.cpp``, built with g++ and loaded with ctypes; an eager chunked torch
  fallback, its chunks stepped with torch's intra-op threads held at 1 by :func:`intra_op_threads`),
  rounding like torch's fused CPU AdamW;
* :mod:`~memlab.offload.streaming`: :func:`install_grad_hooks` (gradients to the host during
  backward) and :class:`StreamedSequential` (inference with layers streamed to the device);
* :mod:`~memlab.offload.optimizer`: :class:`OffloadedAdamW`, a ``torch.optim.Optimizer``
  (its copies between device and host made by a
  :class:`~memlab.offload.transfer.HostTransfer` it holds);
* :mod:`~memlab.offload.memory`: :func:`device_host_bytes`, :func:`predict_device_bytes`;
* :mod:`~memlab.offload.in_backward`: :func:`optimizer_in_backward` (chapter 09), each parameter's
  optimizer stepped by a post-accumulate-grad hook in backward and its gradient freed at once.
"""
from memlab.offload.in_backward import OptimizerInBackward, optimizer_in_backward
from memlab.offload.kernel import (DEFAULT_CHUNK, EAGER_CHUNK, KERNEL_PATH, KERNEL_SOURCE, adamw_step_eager_chunked_,
                                   adamw_step_flat_, intra_op_threads, kernel_name, load_kernel)
from memlab.offload.memory import DEVICE_RECIPES, OFFLOAD_RECIPES, device_host_bytes, predict_device_bytes
from memlab.offload.optimizer import OffloadedAdamW
from memlab.offload.streaming import StreamedSequential, install_grad_hooks
from memlab.offload.update import FlatBuffer, adamw_step_, bias_corrections, check_hparams, pack

__all__ = [
    "adamw_step_",
    "bias_corrections",
    "FlatBuffer",
    "pack",
    "adamw_step_flat_",
    "adamw_step_eager_chunked_",
    "intra_op_threads",
    "kernel_name",
    "load_kernel",
    "KERNEL_SOURCE",
    "DEFAULT_CHUNK",
    "EAGER_CHUNK",
    "OffloadedAdamW",
    "StreamedSequential",
    "device_host_bytes",
    "predict_device_bytes",
    "install_grad_hooks",
    # public since the split
    "check_hparams",
    "KERNEL_PATH",
    "OFFLOAD_RECIPES",
    "DEVICE_RECIPES",
    # chapter 09: the optimizer step in backward
    "optimizer_in_backward",
    "OptimizerInBackward",
]
