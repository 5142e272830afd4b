"""Old path of :mod:`memlab.course.labs`, kept for one release."""
import sys

from memlab.course import labs as _labs

sys.modules[__name__] = _labs
