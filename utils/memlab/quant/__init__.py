"""Quantization for QLoRA and 8-bit optimizers, written to be bit-exact with bitsandbytes 0.50 on CPU.

* :mod:`memlab.quant.codebooks` -- the levels: NF4, FP4, int4, the 8-bit dynamic map.
* :mod:`memlab.quant.blockwise` -- blockwise absmax quantization: NF4 with packing, 8-bit with a
  code, double quantization, bits per parameter; the CPU NF4 dequantize's C++ path (``nf4.cpp``).
* :mod:`memlab.quant.linear4bit` -- :class:`Linear4bit`, a frozen NF4 linear layer (QLoRA's base).
* :mod:`memlab.quant.adam8bit` -- :class:`Adam8bit`, Adam with 8-bit blockwise moments.
* :mod:`memlab.quant.lora` -- LoRA adapters, QLoRA models and their bytes (imported from there).

Dettmers, Pagnoni, Holtzman, Zettlemoyer 2023, "QLoRA" (arXiv:2305.14314); Dettmers, Lewis,
Shleifer, Zettlemoyer 2022, "8-bit Optimizers via Block-wise Quantization" (arXiv:2110.02861).
"""
from __future__ import annotations

from memlab.quant.adam8bit import Adam8bit
from memlab.quant.blockwise import (NF4_BLOCKSIZES, bits_per_param, dequantize_blockwise, dequantize_nf4,
                                    double_dequantize, double_quantize, load_nf4_kernel, nf4_codes, nf4_kernel_name,
                                    pack_nibbles, quantize_blockwise, quantize_nf4, unpack_nibbles)
from memlab.quant.codebooks import NF4_OFFSET, dynamic_map, fp4_codebook, int4_codebook, nf4_codebook
from memlab.quant.linear4bit import Linear4bit

__all__ = [
    "NF4_OFFSET", "NF4_BLOCKSIZES", "nf4_codebook", "fp4_codebook", "int4_codebook", "dynamic_map",
    "nf4_codes", "quantize_nf4", "dequantize_nf4", "pack_nibbles", "unpack_nibbles",
    "quantize_blockwise", "dequantize_blockwise", "double_quantize", "double_dequantize",
    "Linear4bit", "bits_per_param", "Adam8bit", "load_nf4_kernel", "nf4_kernel_name",
]
