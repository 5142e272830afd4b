"""Repository-wide pytest set-up: CUDA-marked tests skip on machines without a GPU."""
import pytest


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: skipped on cpu (no torch.cuda device)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
