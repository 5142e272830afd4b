"""The production losses memlab's is checked against, each loaded only where it can run (None elsewhere).

* torchtune's ``CEWithChunkedOutputLoss`` (``torchtune.modules.loss``, checked with 0.6.1): the
  chunked loss through autograd, taking the head's output as a list of chunks. ``import torchtune``
  needs torchao (0.6.1 imports ``torchao.dtypes.nf4tensor``, which torchao 0.18 no longer has),
  ``datasets`` and more, none of which the course needs: its loss module (plain PyTorch) is loaded
  from its file in an installed torchtune (``pip install --no-deps torchtune``), without the package.
* Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` (``liger_kernel.transformers``, checked with
  0.8.5): chunked head matmuls in PyTorch and a Triton cross-entropy kernel; it runs on CPU tensors
  under Triton's interpreter (``TRITON_INTERPRET=1`` before triton's import), except with ``softcap``
  (its soft-cap branch stops in Triton 3.9's interpreter with ``AttributeError: 'float' object has no
  attribute 'to'``): the GPU run checks that one.
* Cut Cross-Entropy's ``linear_cross_entropy`` (``cut_cross_entropy``, checked with 25.1.1):
  ``impl="torch_compile"`` (``torch.compile`` of the plain loss) runs on a CPU; ``impl="cce"``, its
  Triton kernels, does not run in Triton 3.9's interpreter (``tl_logaddexp`` stops with
  ``AttributeError: 'NoneType' object has no attribute 'dtype'``): the GPU run checks it.
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
from typing import Any, Callable

__all__ = ["torchtune_chunked_loss", "liger_fused_loss", "cce_linear_cross_entropy"]

_CACHE: dict[str, Any] = {}


def torchtune_chunked_loss() -> type | None:
    """torchtune's ``CEWithChunkedOutputLoss`` class, loaded from its module's file, or None where
    torchtune is not installed."""
    if "torchtune" not in _CACHE:
        _CACHE["torchtune"] = None
        try:
            spec = importlib.util.find_spec("torchtune")
        except (ImportError, ValueError):
            spec = None
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        for root in locations:
            path = pathlib.Path(root) / "modules" / "loss" / "ce_chunked_output_loss.py"
            if path.is_file():
                mod_spec = importlib.util.spec_from_file_location("memlab_peer_torchtune_ce_chunked", path)
                module = importlib.util.module_from_spec(mod_spec)
                mod_spec.loader.exec_module(module)
                _CACHE["torchtune"] = module.CEWithChunkedOutputLoss
                break
    return _CACHE["torchtune"]


def liger_fused_loss() -> type | None:
    """Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` class, or None where it is not installed or
    cannot run (on CPU it needs Triton's interpreter, chosen at triton's import)."""
    if "liger" not in _CACHE:
        _CACHE["liger"] = None
        if importlib.util.find_spec("liger_kernel") is not None and importlib.util.find_spec("triton") is not None:
            import torch

            from memlab.loss.triton_fused import triton_interpreted

            if not torch.cuda.is_available():
                if "triton" not in sys.modules:
                    os.environ.setdefault("TRITON_INTERPRET", "1")
                if not triton_interpreted():
                    return None
            try:
                from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
            except Exception:  # noqa: BLE001 - an install that cannot import is "not here"
                return None
            _CACHE["liger"] = LigerFusedLinearCrossEntropyLoss
    return _CACHE["liger"]


def cce_linear_cross_entropy() -> Callable[..., Any] | None:
    """Cut Cross-Entropy's ``linear_cross_entropy(e, c, targets, ..., impl=...)``, or None where it is
    not installed."""
    if "cce" not in _CACHE:
        _CACHE["cce"] = None
        if importlib.util.find_spec("cut_cross_entropy") is not None:
            try:
                from cut_cross_entropy import linear_cross_entropy
            except Exception:  # noqa: BLE001 - an install that cannot import is "not here"
                return None
            _CACHE["cce"] = linear_cross_entropy
    return _CACHE["cce"]
