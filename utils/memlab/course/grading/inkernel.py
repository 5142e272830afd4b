"""What the grader runs inside the notebook's kernel: a fresh import of the checks, then one check."""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Mapping

from memlab.course.grading.registry import get_exercise, safe_str, shorten
from memlab.course.grading.running import chapter_fingerprint, run_checks_watched
from memlab.course.grading.verify import is_grader_module, verify_memlab_modules


# ----------------------------------------------------------------------------- inside the graded kernel
# The grader sends two requests per exercise, right after its check cell. Both run in a private
# namespace, as silent executions (IPython's pre/post_run_cell hooks do not fire), and write their
# answer to a new file whose random name only the request knows, in the grader's private folder;
# nothing the notebook prints is read.
BOOT_PREPARE = r'''
import sys, json, importlib.util
def _memlab_grader_prepare(args):
    def ours(k):
        return any(k == p or k.startswith(p + ".") for p in args["packages"])
    old = {k: m for k, m in list(sys.modules.items()) if ours(k)}
    for k in old:
        del sys.modules[k]
    def load(name, folder):
        spec = importlib.util.spec_from_file_location(
            name, folder + "/__init__.py", submodule_search_locations=[folder])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod
    try:
        import os, memlab
        where = getattr(memlab, "__file__", None) or "?"
        if not os.path.realpath(where).startswith(os.path.realpath(args["dir"]) + os.sep):
            return {"ok": False, "message": "the kernel's memlab comes from " + where + ", not from the grader's "
                    "memlab (" + args["dir"] + "): is there a memlab/ folder next to the notebook?"}
        import memlab.course
        load("memlab.course.grading", args["dir"] + "/course/grading")
        load("memlab.course.checks", args["dir"] + "/course/checks")
        return sys.modules["memlab.course.grading.inkernel"].prepare(args, old)
    except BaseException as exc:
        for k in [k for k in sys.modules if ours(k)]:
            del sys.modules[k]
        sys.modules.update(old)
        return {"ok": False, "message": "the grader could not import memlab's checks in the kernel: "
                                        + type(exc).__name__ + ": " + str(exc)[:300]}
def _memlab_grader_answer(path, data):
    import os
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data))
_memlab_grader_answer(ARGS["answer"], _memlab_grader_prepare(ARGS))
'''

BOOT_RUN = r'''
import sys, json
def _memlab_grader_run(args, user_ns):
    inkernel = sys.modules.get("memlab.course.grading.inkernel")
    if inkernel is None or getattr(inkernel, "PREPARED", {}).get("nonce") != args["prepared"]:
        return {"status": "error", "message": "the grader's fresh copy of the checks was replaced before it ran"}
    return inkernel.run(args, user_ns)
def _memlab_grader_answer(path, data):
    import os
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data))
_memlab_grader_answer(ARGS["answer"], _memlab_grader_run(ARGS, USER_NS))
'''

# the fresh import's state between the two requests: the nonce and the modules it replaced
PREPARED: dict[str, Any] = {}


def _restore_modules(old: Mapping[str, Any]) -> None:
    for k in [k for k in sys.modules if is_grader_module(k)]:
        del sys.modules[k]
    sys.modules.update(old)


def prepare(args: dict[str, Any], old_modules: dict[str, Any]) -> dict[str, Any]:
    """(In the kernel, in a freshly imported memlab.) Load the chapter's checks and compare fingerprints.

    ``args``: the request (memlab's folder, the chapter, the grader's fingerprint, a nonce);
    ``old_modules``: the grader's modules the fresh import replaced (put back on failure).
    Answers ``{"ok": True, "fingerprint": ...}`` or ``{"ok": False, "message": ...}``.
    """
    chapter = args["chapter"]
    try:
        fingerprint = chapter_fingerprint(chapter)
    except BaseException as exc:  # noqa: BLE001
        _restore_modules(old_modules)
        return {"ok": False, "message": shorten(f"the chapter's checks failed to import in the kernel: {type(exc).__name__}: {exc}")}
    root = os.path.realpath(args["dir"])
    foreign = sorted(k for k, m in list(sys.modules.items())
                     if (k == "memlab" or k.startswith("memlab.")) and getattr(m, "__file__", None)
                     and not os.path.realpath(m.__file__).startswith(root + os.sep))
    if foreign:
        _restore_modules(old_modules)
        where = getattr(sys.modules[foreign[0]], "__file__", "?")
        return {"ok": False, "message": f"the kernel's {foreign[0]} comes from {where}, not from the grader's memlab "
                                        f"({root}): is there a memlab/ folder next to the notebook?"}
    if fingerprint != args["fingerprint"]:
        _restore_modules(old_modules)
        return {"ok": False, "fingerprint": fingerprint,
                "message": "the checks the kernel imports differ from memlab's own (fingerprint mismatch): "
                           "is another `memlab` package on the notebook's path?"}
    changed = verify_memlab_modules(root)
    if changed:
        _restore_modules(old_modules)
        return {"ok": False, "message": f"{changed}: memlab's reference code was changed in the notebook's kernel; "
                                        "the checks need memlab's own: restart the kernel and do not patch memlab"}
    PREPARED.update(nonce=args["nonce"], old=old_modules)
    return {"ok": True, "fingerprint": fingerprint}


def _resolve(name: str, user_ns: Mapping[str, Any]) -> Any:
    """The learner's object ``name`` (``a`` or ``a.b.c``) from the notebook's namespace; NameError if absent."""
    first, *rest = name.split(".")
    if first not in user_ns:
        raise NameError(f"name {first!r} is not defined in the notebook when its check runs")
    obj = user_ns[first]
    for part in rest:
        obj = getattr(obj, part)
    return obj


def run(args: dict[str, Any], user_ns: Mapping[str, Any]) -> dict[str, Any]:
    """(In the kernel, in the fresh memlab.) Run one exercise's checks on the learner's object, named
    in ``args`` (with the limit and the prepare request's nonce) and looked up in ``user_ns``.
    Answers ``{"status", "message", "reference", "seconds"}``.
    """
    old = PREPARED.get("old", {})
    start = time.perf_counter()
    try:
        ex = get_exercise(args["exercise"])
        try:
            obj = _resolve(args["name"], user_ns)
        except BaseException as exc:  # noqa: BLE001 - a hostile __getattr__ included
            return {"status": "error", "message": shorten(f"{type(exc).__name__}: {safe_str(exc)}"), "seconds": 0.0}
        changed = verify_memlab_modules(args["dir"])
        if not changed:
            status, message, note = run_checks_watched(ex, obj, args["limit"])
            changed = verify_memlab_modules(args["dir"])  # the learner's code ran: look again
        if changed:
            return {"status": "error", "seconds": round(time.perf_counter() - start, 3),
                    "message": f"{changed}: memlab's reference code was changed in the notebook's kernel; the check "
                               "needs memlab's own: restart the kernel and do not patch memlab"}
        return {"status": status, "message": message, "reference": note,
                "seconds": round(time.perf_counter() - start, 3)}
    except BaseException as exc:  # noqa: BLE001
        return {"status": "error", "message": shorten(f"the grader failed: {type(exc).__name__}: {safe_str(exc)}")}
    finally:
        PREPARED.clear()
        _restore_modules(old)


def request(boot: str, args: dict[str, Any], with_namespace: bool = False) -> str:
    """One line of code for the kernel: ``boot`` (:data:`BOOT_PREPARE` or :data:`BOOT_RUN`) run in a
    private namespace with ``args`` (plain data), and the notebook's namespace if ``with_namespace``."""
    ns = "{'__builtins__': __import__('builtins'), 'ARGS': %s%s}" % (
        repr(args), ", 'USER_NS': globals()" if with_namespace else "")
    return f"__import__('builtins').exec({boot!r}, {ns})"

