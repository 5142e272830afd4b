"""Memlab's modules in a kernel, compared with their source files (a patched reference is found)."""
from __future__ import annotations

import inspect
import os
import sys
import types
from pathlib import Path
from typing import Any

from memlab.course.grading.registry import MEMLAB_DIR, is_learner_file


# The modules the grader imports afresh inside the kernel.
GRADER_PACKAGES = ("memlab.course.grading", "memlab.course.checks")

_COMPILED: dict[tuple[str, float], dict[str, Any]] = {}


def is_grader_module(name: str) -> bool:
    """Whether the dotted module ``name`` is one the grader imports afresh in the kernel (the grading
    package, the checks and their submodules)."""
    return any(name == p or name.startswith(p + ".") for p in GRADER_PACKAGES)


def _code_table(path: str) -> dict[str, Any]:
    """For a memlab source file: its top-level functions, classes (with their methods) and literal
    constants, and every code object it compiles to, by qualified name."""
    key = (path, os.stat(path).st_mtime)
    if key in _COMPILED:
        return _COMPILED[key]
    import ast

    source = Path(path).read_text(encoding="utf-8")
    tree = ast.parse(source)
    codes: dict[str, types.CodeType] = {}

    def walk(code: types.CodeType) -> None:
        codes.setdefault(code.co_qualname, code)
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                walk(c)

    walk(compile(tree, path, "exec"))
    functions, classes, constants = set(), {}, {}
    # names the module rebinds (assigned twice at top level, augmented, or declared global in a
    # function) are state, not constants
    seen: dict[str, int] = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        seen[n.id] = seen.get(n.id, 0) + (2 if isinstance(node, ast.AugAssign) else 1)
    rebound = {k for k, v in seen.items() if v > 1}
    rebound |= {name for n in ast.walk(tree) if isinstance(n, ast.Global) for name in n.names}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions.add(node.name)
        elif isinstance(node, ast.ClassDef):
            classes[node.name] = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            try:
                value = ast.literal_eval(node.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue
            if not isinstance(value, (int, float, str, bytes, tuple, frozenset, type(None))):
                continue  # a mutable registry ({}, []) that the module fills later
            for t in targets:
                if isinstance(t, ast.Name) and not t.id.startswith("__") and t.id not in rebound:
                    constants[t.id] = value
    table = {"codes": codes, "functions": functions, "classes": classes, "constants": constants}
    _COMPILED[key] = table
    return table


def same_code(a: types.CodeType, b: types.CodeType) -> bool:
    """Whether two code objects compute the same: bytecode, names and constants (nested code compared alike);
    line numbers, file and variable names aside."""
    if a.co_code != b.co_code or a.co_names != b.co_names or len(a.co_consts) != len(b.co_consts):
        return False
    for x, y in zip(a.co_consts, b.co_consts):
        if isinstance(x, types.CodeType) or isinstance(y, types.CodeType):
            if not (isinstance(x, types.CodeType) and isinstance(y, types.CodeType) and same_code(x, y)):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def _function_ok(obj: Any, qualname: str, table: dict[str, Any]) -> bool:
    """Whether ``obj`` (a module's or a class's attribute) still runs the code ``qualname`` of the file."""
    for f in (getattr(obj, "__func__", None), getattr(obj, "fget", None), obj):
        if f is None:
            continue
        if isinstance(f, types.FunctionType) and is_learner_file(f.__code__.co_filename):
            return False  # a wrapper written in the notebook
        try:
            inner = inspect.unwrap(f)
        except ValueError:
            return False
        if isinstance(inner, types.FunctionType):
            want = table["codes"].get(qualname)
            return want is not None and inner.__qualname__ == qualname and same_code(inner.__code__, want)
    return True  # not a Python function (a C object made by a decorator): nothing to compare


def _module_changed(name: str, mod: Any, root: str) -> str:
    """'' when module ``name`` in ``sys.modules`` still holds its file's code; else what changed."""
    file = getattr(mod, "__file__", None)
    if not isinstance(mod, types.ModuleType) or not isinstance(file, str):
        return f"sys.modules[{name!r}] is not memlab's module (a {type(mod).__name__})"
    if mod.__name__ != name:
        return f"sys.modules[{name!r}] is {mod.__name__}, not memlab's module of that name"
    real = os.path.realpath(file)
    if not real.startswith(root + os.sep) or not real.endswith(".py"):
        return f"sys.modules[{name!r}] comes from {file}, not from memlab's folder {root}"
    try:
        table = _code_table(real)
    except (OSError, SyntaxError, ValueError) as exc:
        return f"{name}: cannot read {file} ({type(exc).__name__})"
    ns = vars(mod)
    gone = sorted(n for n in (*table["functions"], *table["classes"]) if n not in ns)
    if gone:
        return f"{name} has no {gone[0]} (defined in {file}): the module was replaced or changed in the kernel"
    for fname in table["functions"]:
        if not _function_ok(ns[fname], fname, table):
            return f"{name}.{fname} was replaced or changed in the kernel"
    for cname, methods in table["classes"].items():
        changed = _class_changed(name, cname, ns.get(cname), methods, table)
        if changed:
            return changed
    for const, value in table["constants"].items():
        if const in ns and not (type(ns[const]) is type(value) and ns[const] == value):
            return f"{name}.{const} was changed in the kernel"
    return ""


def _class_changed(name: str, cname: str, cls: Any, methods: set[str], table: dict[str, Any]) -> str:
    """'' when class ``cname`` of module ``name`` is still its file's class with its file's methods."""
    if cls is None:
        return ""
    if not isinstance(cls, type) or cls.__qualname__ != cname or cls.__module__ != name:
        return f"{name}.{cname} was replaced in the kernel"
    for mname, value in list(vars(cls).items()):
        if mname in methods:
            ok = _function_ok(value, f"{cname}.{mname}", table)
        elif isinstance(value, (types.FunctionType, staticmethod, classmethod, property)):
            # a method the class body does not define (a dataclass's, an Enum's generated ones):
            # refused when the notebook wrote it
            f = getattr(value, "__func__", None) or getattr(value, "fget", None) or value
            filename = getattr(getattr(f, "__code__", None), "co_filename", "<string>")
            ok = filename == "<string>" or not is_learner_file(filename)
        else:
            continue
        if not ok:
            return f"{name}.{cname}.{mname} was replaced or added in the kernel"
    if any(m not in vars(cls) for m in methods):
        return f"a method of {name}.{cname} was deleted in the kernel"
    return ""


def _submodule_attributes_changed() -> str:
    """'' when each package's attribute for a submodule is that submodule (``from memlab import accounting``)."""
    for name, mod in list(sys.modules.items()):
        if "." in name and name.startswith("memlab.") and isinstance(mod, types.ModuleType) and not is_grader_module(name):
            parent, _, leaf = name.rpartition(".")
            pkg = sys.modules.get(parent)
            if pkg is not None and leaf in vars(pkg) and vars(pkg)[leaf] is not mod:
                return f"{parent}.{leaf} is not sys.modules[{name!r}]: a module was replaced in the kernel"
    return ""


def _checks_bindings_changed() -> str:
    """'' when every name the (fresh) checks bound from memlab's modules is that module's own object."""
    for name, mod in list(sys.modules.items()):
        if not (is_grader_module(name) and isinstance(mod, types.ModuleType)):
            continue
        for key, value in list(vars(mod).items()):
            if isinstance(value, types.ModuleType) and str(getattr(value, "__name__", "")).startswith("memlab"):
                if sys.modules.get(value.__name__) is not value:
                    return f"{name}.{key} is not sys.modules[{value.__name__!r}]: a module was replaced in the kernel"
                continue
            origin = getattr(value, "__module__", None) if isinstance(value, (types.FunctionType, type)) else None
            if not (isinstance(origin, str) and origin.startswith("memlab.")) or is_grader_module(origin):
                continue
            owner = sys.modules.get(origin)
            top = str(getattr(value, "__qualname__", "")).split(".")[0]
            if owner is None or "<" in top:
                continue
            if getattr(owner, top, None) is not value and "." not in value.__qualname__:
                return f"{name}.{key} is not {origin}.{top}: it was replaced in the kernel"
    return ""


def verify_memlab_modules(root: str | None = None) -> str:
    """Whether every ``memlab`` module the kernel has imported still holds its file's code.

    Every memlab module in ``sys.modules`` (whatever sub-package it lives in) must be loaded from
    ``root``; every top-level function and every method of a top-level class must run the code its
    source file compiles to (a replaced function, a patched ``__code__``, a wrapper, a rebound name
    all show), every class must still be that file's class, and every literal constant must hold
    its value. The grader calls it in the kernel before and after a check runs, so that a notebook that
    patches memlab's reference (or ``sys.modules``) cannot make a wrong answer pass.

    Args:
        root: memlab's folder (default: the folder this memlab was imported from).

    Returns:
        '' when nothing changed; else one line saying what changed.
    """
    root = os.path.realpath(root or MEMLAB_DIR)
    for name, mod in sorted(list(sys.modules.items()), key=lambda kv: kv[0]):
        if not (name == "memlab" or name.startswith("memlab.")) or is_grader_module(name) or mod is None:
            continue
        changed = _module_changed(name, mod, root)
        if changed:
            return changed
    return _submodule_attributes_changed() or _checks_bindings_changed()
