"""Old path of :mod:`memlab.training_state`, kept for one release: ``from memlab import ckpt`` still works."""
import sys

from memlab import training_state as _training_state

sys.modules[__name__] = _training_state
