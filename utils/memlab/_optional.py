"""Old path of :mod:`memlab.optional`, kept for one release."""
import sys

from memlab import optional as _optional

sys.modules[__name__] = _optional
