"""LLM Memory Lab: GPU-memory techniques for training language models, built from scratch.

One module or small package per technique of the course (``memlab.profiler``, ``memlab.checkpoint``,
``memlab.amp``, ``memlab.quant``, ``memlab.quant.lora`` ...), the models they run on (``memlab.models``)
and the byte accounting they are checked against (``memlab.accounting``). ``memlab.core`` holds
what every module shares (units, argument checks, the vocabulary, the GPU table; no torch);
``memlab.config`` decides the device and scale once; the course machinery (grading, checks,
labs, doctor) lives in ``memlab.course``, out of the techniques' way.

Nothing is imported here: ``import memlab`` stays cheap and works without transformers, peft or
bitsandbytes, and each submodule (``import memlab.quant``, ``from memlab import lora``) is
imported when asked for.
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
