"""Old path of :mod:`memlab.course.doctor`, kept for one release (``python -m memlab.doctor`` included)."""
import sys

from memlab.course import doctor as _doctor

if __name__ == "__main__":  # pragma: no cover - python -m memlab.doctor
    sys.exit(_doctor.main())
sys.modules[__name__] = _doctor
