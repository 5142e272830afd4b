"""memlab's layout rules (CONTRIBUTING.md, "Layout"), checked on the source itself.

- no module over MAX_MODULE_LINES lines and no function over MAX_FUNCTION_LINES, except the
  entries of the allow-lists below, each with its reason;
- no private name (``_x``) imported from another module, except between modules of one
  sub-package (``memlab.estimate.trace`` may use ``memlab.estimate.spec._Spec``); notebooks use no
  private memlab name at all;
- the old import paths of moved modules still import, and give the new module's objects.
"""
from __future__ import annotations

import ast
import importlib
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "utils" / "memlab"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80

# module (relative to utils/memlab) -> why it may be longer
LONG_MODULES: dict[str, str] = {}
# "module:function" -> why it may be longer
LONG_FUNCTIONS: dict[str, str] = {}

# old import path -> new one (re-exported for one release)
MOVED: dict[str, str] = {
    "memlab.core.gpus": "memlab.core.gpus",
    "memlab.core.optional": "memlab.core.optional",
    "memlab.attention.triton_kernels": "memlab.attention.triton_kernels",
    "memlab.train.state": "memlab.train.state",
    "memlab.course.grading": "memlab.course.grading",
    "memlab.course.checks": "memlab.course.checks",
    "memlab.course.labs": "memlab.course.labs",
    "memlab.course.doctor": "memlab.course.doctor",
}


def _modules() -> list[pathlib.Path]:
    return sorted(p for p in PKG.rglob("*.py") if "egg-info" not in str(p))


def _dotted(p: pathlib.Path) -> str:
    rel = p.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _package_of(p: pathlib.Path) -> str:
    d = _dotted(p)
    return d if p.name == "__init__.py" else d.rsplit(".", 1)[0]


def test_no_module_over_the_line_limit():
    long = {}
    for p in _modules():
        rel = str(p.relative_to(PKG))
        n = len(p.read_text().splitlines())
        if n > MAX_MODULE_LINES and rel not in LONG_MODULES:
            long[rel] = n
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them, or say why in LONG_MODULES): {long}"


def test_no_function_over_the_line_limit():
    long = {}
    for p in _modules():
        rel = str(p.relative_to(PKG))
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES and f"{rel}:{node.name}" not in LONG_FUNCTIONS:
                    long[f"{rel}:{node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them, or say why in LONG_FUNCTIONS): {long}"


def _private_uses(tree: ast.AST, importer_pkg: str | None, resolve_relative) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = resolve_relative(node) if node.level else node.module
            if not mod or not mod.startswith("memlab"):
                continue
            names = [a.name for a in node.names]
            private_mod = any(part.startswith("_") and not part.startswith("__") for part in mod.split("."))
            for name in names:
                target = f"{mod}.{name}"
                if name.startswith("_") and not name.startswith("__") or private_mod:
                    src_pkg = mod if (PKG.parent / mod.replace(".", "/")).is_dir() else mod.rsplit(".", 1)[0]
                    if importer_pkg is None or src_pkg != importer_pkg or src_pkg == "memlab":
                        out.append(target)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("memlab") and any(x.startswith("_") and not x.startswith("__")
                                                       for x in a.name.split(".")):
                    out.append(a.name)
    return out


def test_no_private_name_imported_across_modules():
    found = {}
    for p in _modules():
        dotted, pkg = _dotted(p), _package_of(p)

        def resolve(node, pkg=pkg):
            base = pkg.split(".")
            if node.level > 1:
                base = base[: len(base) - (node.level - 1)]
            return ".".join(base + ([node.module] if node.module else []))

        uses = _private_uses(ast.parse(p.read_text()), pkg, resolve)
        # an old path's re-export shim imports its new module by design
        if uses and dotted not in MOVED:
            found[str(p.relative_to(PKG))] = uses
    assert not found, f"private memlab names imported across modules (make them public): {found}"


def _notebooks() -> list[pathlib.Path]:
    return sorted(p for d in ("notebooks", "solutions", "labs") for p in (ROOT / d).glob("*.ipynb"))


@pytest.mark.parametrize("nb", _notebooks(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_notebooks_use_no_private_memlab_name(nb):
    bad = []
    for cell in json.loads(nb.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "\n".join(line for line in "".join(cell["source"]).splitlines()
                        if not line.lstrip().startswith(("%", "!")))
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        bad += _private_uses(tree, None, lambda node: node.module)
        for node in ast.walk(tree):  # memlab.x._y
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                v, chain = node.value, []
                while isinstance(v, ast.Attribute):
                    chain.append(v.attr)
                    v = v.value
                if isinstance(v, ast.Name) and v.id == "memlab":
                    bad.append("memlab." + ".".join(reversed(chain + [])) + "." + node.attr)
    assert not bad, f"{nb.name} uses private memlab names: {bad}"


@pytest.mark.parametrize("old,new", sorted(MOVED.items()))
def test_old_import_paths_re_export(old, new):
    old_mod, new_mod = importlib.import_module(old), importlib.import_module(new)
    public = getattr(new_mod, "__all__", None) or [n for n in vars(new_mod) if not n.startswith("_")]
    assert public, f"{new} exports nothing"
    for name in public:
        assert getattr(old_mod, name) is getattr(new_mod, name), f"{old}.{name} is not {new}.{name}"


def test_contributing_map_names_existing_paths():
    """Every path in CONTRIBUTING.md's map (technique modules, tests, checks, mutants) exists."""
    import re

    text = (ROOT / "CONTRIBUTING.md").read_text()
    start = text.index("## The map")
    rows = [ln for ln in text[start:].splitlines() if re.match(r"^\| 0\d \|", ln)]
    assert len(rows) == 9, "the map has one row per chapter 00-08"
    missing = []
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        tech, tests, checks, mutants = cells[1], cells[2], cells[3], cells[4]
        for name in re.findall(r"`([\w/.]+)`", tech.split("(")[0] + " " + " ".join(
                re.findall(r"^`[\w/.]+`|, `[\w/.]+`(?![^(]*\))", tech))):
            if not (PKG / name).exists():
                missing.append(f"utils/memlab/{name}")
        for name in re.findall(r"`([\w/.]+)`", tests):
            if not (ROOT / "tests" / name).exists():
                missing.append(f"tests/{name}")
        for name in re.findall(r"`(ch\d\d\.py)`", checks):
            if not (PKG / "course" / "checks" / name).exists():
                missing.append(name)
        for name in re.findall(r"`(ch\d\d\.py)`", mutants):
            if not (ROOT / "tests" / "mutants" / name).exists():
                missing.append(f"mutants/{name}")
        # the files named inside a package's parentheses
        for pkg, inner in re.findall(r"`([\w]+/)` \(([^)]*)\)", tech):
            for name in re.findall(r"`([\w.]+\.(?:py|cpp))`", inner):
                if not (PKG / pkg / name).exists():
                    missing.append(f"utils/memlab/{pkg}{name}")
    assert not missing, f"CONTRIBUTING.md's map names paths that do not exist: {missing}"


def _is_registered_check(node: ast.FunctionDef) -> bool:
    return node.name.startswith("check_") and any(
        isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id == "register" for d in node.decorator_list)


def test_public_functions_document_args_and_returns():
    """Every public function and method says ``Args:`` (when it takes any) and ``Returns:`` (or ``Yields:``)."""
    missing = []
    for p in _modules():
        rel = str(p.relative_to(PKG))

        def visit(body, owner=""):
            for node in body:
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    visit(node.body, node.name + ".")
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if node.name.startswith("_") or any(
                            isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list):
                        continue
                    if _is_registered_check(node):  # the contract is stated once, in memlab.course.checks
                        continue
                    args = [a.arg for a in node.args.args + node.args.kwonlyargs if a.arg not in ("self", "cls")]
                    doc = ast.get_docstring(node) or ""
                    if (args and "Args:" not in doc) or ("Returns:" not in doc and "Yields:" not in doc):
                        missing.append(f"{rel}:{owner}{node.name}")

        visit(ast.parse(p.read_text()).body)
    assert not missing, f"public functions without Args:/Returns: sections: {missing}"
