"""``memlab doctor``: an environment report a learner can paste into a bug report.

Usage::

    memlab doctor            # aligned text report
    memlab doctor --json     # the same lines as JSON
    python -m memlab.course.doctor  # without the console script

Every check produces one :class:`CheckLine` with a status:

* ``OK``: fine.
* ``WARN``: the course still runs, but something is missing or runs at reduced scale
  (no CUDA GPU, an optional package absent ...). The detail says which chapters are affected.
* ``FAIL``: the course cannot run until this is fixed (no torch, Python too old, an
  environment variable that ``memlab.config`` will reject, a package the notebooks or the grader
  import: transformers, nbclient, ipykernel).

The report ends with two verdicts: whether memlab's core (``pip install ./utils``: torch, numpy,
matplotlib, tqdm) can run, and whether the whole course can (the ``hf`` and ``grade`` extras,
JupyterLab). ``memlab doctor`` exits 1 when the course cannot run, even if the core can.

Design rules: the doctor never crashes because one package is broken (every optional import is
lazy and wrapped in ``try/except Exception``), it needs no network and no notebooks, and it is
quick: only ``torch`` and ``bitsandbytes`` are imported; every other package is looked up through
``importlib.metadata`` without importing it.
"""
from memlab.course.doctor.checks import CORE_CHECKS, MINIMUMS, STATUSES, CheckLine, run_checks
from memlab.course.doctor.report import core_summary, exit_code, format_report, main, summarize

__all__ = ["CheckLine", "run_checks", "main", "summarize", "core_summary", "format_report", "exit_code",
           "CORE_CHECKS", "MINIMUMS", "STATUSES"]
