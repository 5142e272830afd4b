"""Old path of :mod:`memlab.core.gpus`, kept for one release: ``import memlab.gpus`` still works."""
import sys

from memlab.core import gpus as _gpus

sys.modules[__name__] = _gpus
