"""LLM Memory Lab: GPU-memory techniques for training language models, built from scratch.

Each module is one technique of the course (``memlab.profiler``, ``memlab.checkpoint``,
``memlab.amp`` ...); ``memlab.config`` decides the device and scale once; ``memlab.course``
holds the course's machinery (grading, checks, labs, doctor). Submodules are imported on demand, so ``import memlab``
stays cheap and works without transformers, peft or bitsandbytes installed.
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
