"""Repository-wide pytest set-up: CUDA-marked tests skip on machines without a GPU, and Triton runs in its
interpreter there (chapter 05's and 09's kernels on a CPU), set before any test module imports triton."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: skipped on cpu (no torch.cuda device)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
