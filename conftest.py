"""Repository-wide pytest set-up: CUDA-marked tests skip on machines without a GPU, and Triton runs in its
interpreter there (chapter 05's and 09's kernels on a CPU), set before any test module imports triton; the trace
cache is a fresh folder of the run's own."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tests' own trace cache, empty at the start of the run: what memlab traced on this machine before (its
# ~/.cache/memlab) must not answer a test's estimate (one read from the cache needs no transformers and traces
# nothing: a `memlab estimate llama-2-7b` run before `make test` failed a test), and the tests leave the user's cache
# alone. pytest-xdist's workers inherit it from the controller; a MEMLAB_CACHE_DIR the caller set is kept.
if "MEMLAB_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["MEMLAB_CACHE_DIR"] = tempfile.mkdtemp(prefix="memlab-test-traces-")
    atexit.register(shutil.rmtree, os.environ["MEMLAB_CACHE_DIR"], True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: skipped on cpu (no torch.cuda device)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
