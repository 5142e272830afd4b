"""The course's machinery, kept out of the way of the technique modules a learner reads.

:mod:`memlab.course.grading` (``check``, ``memlab grade``), :mod:`memlab.course.checks` (one module
of graded checks per chapter), :mod:`memlab.course.labs` (``memlab labs``: labs generated from the
solutions, the learner's ``work/``) and :mod:`memlab.course.doctor` (``memlab doctor``).
Submodules are imported on demand.
"""
