"""The lab reference answers, one module per chapter: what each graded exercise is checked against.

The lectures and the labs build these pieces; the tested technique API they lead to lives in the
technique modules (``memlab.profiler.MemoryTracker`` for chapter 01).
"""
