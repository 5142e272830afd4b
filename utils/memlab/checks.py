"""Old path of :mod:`memlab.course.checks`, kept for one release.

``memlab.checks`` and each ``memlab.checks.chNN`` are the very module objects of the new path: each
chapter's module is registered under its old name too (a second copy would register its exercises
twice).
"""
import importlib
import pkgutil
import sys

from memlab.course import checks as _checks

for _info in pkgutil.iter_modules(_checks.__path__):
    sys.modules[f"{__name__}.{_info.name}"] = importlib.import_module(f"{_checks.__name__}.{_info.name}")
sys.modules[__name__] = _checks
