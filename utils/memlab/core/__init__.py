"""What every memlab module shares: byte units, argument checks, the course's vocabulary and the GPU table.

Nothing here imports torch, so the command line can check its arguments before loading it.
"""
from memlab.core import gpus, units, validation, vocab
from memlab.core.units import GB, GiB, KiB, MiB, TiB, format_bytes, parse_size
from memlab.core.validation import (check_bool, check_choice, check_int, check_number, check_positive_int,
                                    invalid)
from memlab.core.vocab import CATEGORIES, PHASES, Category, Optimizer, Phase, Recipe

__all__ = ["gpus", "units", "validation", "vocab", "KiB", "MiB", "GiB", "TiB", "GB", "format_bytes",
           "parse_size", "invalid", "check_int", "check_positive_int", "check_number", "check_choice",
           "check_bool", "Recipe", "Optimizer", "Category", "Phase", "CATEGORIES", "PHASES"]
