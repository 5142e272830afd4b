"""Old path of :mod:`memlab.attention.triton_kernels`, kept for one release: ``import memlab.attention_triton`` still works."""
import sys

from memlab.attention import triton_kernels as _triton_kernels

sys.modules[__name__] = _triton_kernels
