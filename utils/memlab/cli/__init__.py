"""The ``memlab`` command.

    memlab doctor                      environment report for bug reports
    memlab grade [PATH|NN ...]         grade lab notebooks, or lab NN (default: work/*.ipynb, else labs/*.ipynb)
    memlab labs start | reset NN       copy the labs into work/ (never overwriting), or a fresh copy
    memlab labs build | check          generate labs/ from solutions/, or check for drift and leaks
    memlab bench NAME [...]            from-scratch vs production, side by side (memlab bench --list)
    memlab estimate MODEL [...]        will this fine-tune fit? (chapter 01)
    memlab plan MODEL [...]            which stack fits a memory budget, cheapest first (chapter 07)
    memlab explain FILE                what held the memory at an OOM: snapshot, timeline or message (chapter 01)

A command whose optional dependency is missing prints one line naming the extra to install
(``memlab estimate needs transformers: pip install 'memlab[hf]'``) and exits 2.

An argument error is one line on stderr, ``memlab estimate: error: ... (memlab estimate --help
for usage)``, exit code 2: every command's argparse parser prints its usage only for ``--help``.
``memlab grade`` and ``memlab labs`` parse their arguments before anything heavy is imported;
so do ``estimate`` and ``plan``, whose parsers live in the torch-free :mod:`memlab.cli.args`
(an argument error comes before the torch import, not after it). ``bench``
defines its parser in a module that imports torch, so its argument errors come after that import.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys

from memlab.core.optional import EXTRAS, MissingExtraError, missing_optional
from memlab.cli.args import PARSERS

_COMMANDS = {
    "doctor": ("memlab.course.doctor", "main", "environment report for bug reports"),
    "grade": ("memlab.course.grading", "grade_main", "grade lab notebooks headless, or lab NN (default: work/, else labs/)"),
    "labs": ("memlab.course.labs", "main", "labs start | reset NN | build | check"),
    "bench": ("memlab.bench", "main", "benchmarks: from-scratch vs production"),
    "estimate": ("memlab.cli.estimate", "main", "estimate training memory without a GPU"),
    "plan": ("memlab.cli.plan", "main", "pick the stack that fits a memory budget (chapter 07)"),
    "explain": ("memlab.cli.explain", "main", "what held the memory at an OOM (snapshot, timeline, message)"),
}


def _usage() -> str:
    lines = ["usage: memlab COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<10}{help_}" for name, (_, _, help_) in _COMMANDS.items()]
    lines += ["", "memlab COMMAND --help for a command's options"]
    return "\n".join(lines)


def _one_line_error(self: argparse.ArgumentParser, message: str) -> None:
    """argparse's error(), without the usage block: the one line that matters, and where help is."""
    self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help for usage)\n")


def one_line_errors() -> None:
    """Make every argparse parser of this process report an argument error in one line (the
    ``memlab`` command calls it first; a parser class that overrides ``error`` keeps its own)."""
    argparse.ArgumentParser.error = _one_line_error  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    """Run the ``memlab`` command on ``argv``, the arguments after ``memlab`` (None: ``sys.argv[1:]``).

    Returns:
        The command's exit status; 2 for an unknown command or a missing optional package. An
        argument error raises SystemExit(2) after one line on stderr.
    """
    original = argparse.ArgumentParser.error
    one_line_errors()
    try:
        return _main(argv)
    finally:  # called in-process (tests, notebooks): argparse is left as it was
        argparse.ArgumentParser.error = original  # type: ignore[method-assign]


# commands whose process ends by os._exit once their output is flushed: after transformers and torch's fake
# mode are imported, the interpreter's own teardown (freeing every module and cached object one by one) took
# 1.0 s of a 4.6 s estimate (measured on 2 cores). Only commands that leave nothing to atexit: no temporary
# directory, no child process still running (the plan stops its look-ahead child before it returns).
# They also run with Python's cyclic garbage collector off (gc.disable, unless MEMLAB_GC=1): importing torch,
# memlab's estimator and transformers' Llama ran some 900 collections, 0.70-0.74 s of a 2.9-3.1 s import, the
# full ones rescanning every object the imports had made (2.15-2.25 s with it off); a cold
# `memlab estimate llama-2-7b --gpu rtx4090` went from 7.1-7.2 s to 5.8-6.2 s and the plan's worked case from
# 18.7 s to 15.6 s, for 16 MiB (estimate) and 60 MiB (plan) more peak memory left in uncollected cycles (2 cores,
# 2026-11-29). The process is short and ends by os._exit: nothing it leaves needs collecting.
_QUICK_EXIT = ("estimate", "plan")


def console() -> None:
    """The ``memlab`` console script and ``python -m memlab``: :func:`main`, then exit with its status.

    ``estimate`` and ``plan`` flush stdout and stderr and leave by ``os._exit``, skipping the interpreter's
    teardown (1.0 s after a cold estimate), unless a tracer, a profiler (cProfile) or coverage is running (they write at exit) or
    ``MEMLAB_QUICK_EXIT=0``. An exception or ``SystemExit`` leaves the normal way. They run with the cyclic garbage
    collector off (a cold estimate a sixth faster, its imports a quarter; ``MEMLAB_GC=1`` keeps it on).
    """
    argv = sys.argv[1:]
    if argv and argv[0] in _QUICK_EXIT and os.environ.get("MEMLAB_GC", "0") != "1":
        import gc

        gc.disable()  # see _QUICK_EXIT
    rc = main(argv)
    quick = (bool(argv) and argv[0] in _QUICK_EXIT and sys.gettrace() is None and sys.getprofile() is None
             and "coverage" not in sys.modules
             and os.environ.get("MEMLAB_QUICK_EXIT", "1") != "0")
    if quick:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):  # a closed pipe: exit the normal way, which reports it
            sys.exit(rc)
        os._exit(rc)
    sys.exit(rc)


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from memlab import __version__

        print(f"memlab {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in _COMMANDS:
        close = difflib.get_close_matches(name, list(_COMMANDS), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        print(f"memlab: unknown command {name!r}{hint}; allowed: {', '.join(_COMMANDS)}", file=sys.stderr)
        return 2
    module, func, _ = _COMMANDS[name]
    if name in PARSERS:  # argument errors (and --help) before the command's module imports torch
        PARSERS[name](rest)
    try:
        mod = importlib.import_module(module)
        code = getattr(mod, func)(rest)
    except MissingExtraError as exc:
        print(exc.for_feature(f"memlab {name}"), file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if exc.name == module:
            print(f"memlab {name}: not available in this version of memlab", file=sys.stderr)
            return 2
        optional = missing_optional(exc)
        if optional is not None:  # an optional import not wrapped in memlab.core.optional.needs
            print(MissingExtraError(f"memlab {name}", optional, EXTRAS[optional]), file=sys.stderr)
            return 2
        raise
    return int(code or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
