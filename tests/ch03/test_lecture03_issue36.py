"""Lecture 03 (issue 36): under autocast the loss's log-softmax is saved in fp32 on CUDA too (log_softmax is
on CUDA autocast's fp32 list, which memlab.estimate.cuda_rules applies on a CPU); the page no longer says
it is bf16 there, and its memory table sits beside the allocator's figures."""
from __future__ import annotations

import json
import pathlib

import torch

from memlab.estimate.cuda_rules import CUDA_FP32_OPS, cuda_semantics
from memlab.models import TinyGPT, TinyGPTConfig

LECTURE_03 = pathlib.Path(__file__).resolve().parents[2] / "notebooks" / "03_mixed_precision.ipynb"


def _cells(kind):
    return ["".join(c["source"]) for c in json.loads(LECTURE_03.read_text())["cells"] if c["cell_type"] == kind]


def _saved_dtypes_by_op(model, x, y):
    saved = {}

    def pack(t):
        if t.grad_fn is not None:
            saved.setdefault(type(t.grad_fn).__name__, set()).add(t.dtype)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(x, y)
    return saved


def test_cuda_autocast_keeps_the_loss_log_softmax_and_the_attention_softmax_in_fp32():
    assert {"log_softmax", "softmax"} <= CUDA_FP32_OPS
    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
    x = torch.randint(0, 256, (2, 16))
    with cuda_semantics():
        on_cuda = _saved_dtypes_by_op(model, x, x)
    on_cpu = _saved_dtypes_by_op(model, x, x)
    assert on_cuda["LogSoftmaxBackward0"] == {torch.float32} == on_cpu["LogSoftmaxBackward0"]
    assert on_cuda["SoftmaxBackward0"] == {torch.float32} and on_cpu["SoftmaxBackward0"] == {torch.bfloat16}


def test_the_lecture_says_fp32_for_the_log_softmax_on_both_devices():
    text = " ".join(" ".join(_cells("markdown")).split())
    assert "that one is bf16" not in text
    assert "in fp32 (`LogSoftmaxBackward0`), on a GPU too" in text
    code = "\n".join(_cells("code"))
    # asserted on every device, not swapped for the attention softmax on CUDA as the old cell did
    assert 'assert ("float32", "LogSoftmaxBackward0") in by_origin' in code
    assert '"LogSoftmaxBackward0" if DEVICE.type == "cpu"' not in code


def test_the_memory_table_is_printed_beside_the_allocator():
    code = "\n".join(_cells("code"))
    assert "peak_beside_allocator(lambda: step(x, y), m, opt" in code
    assert "abs(c.gap) <= 0.01 * c.allocator" in code
