"""``python -m memlab.course.doctor``."""
import sys

from memlab.course.doctor.report import main

sys.exit(main())
