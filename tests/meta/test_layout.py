"""memlab's layout (CONTRIBUTING.md, "The map" and "Layout"), checked on the source itself.

- the import graph of memlab's modules (module-level and lazy imports alike) has no circle, and no
  import runs up the layers of LAYERS: nothing in the library imports the command line (``memlab.cli``)
  or the course machinery (``memlab.course``);
- no module is a shim for an old import path (the 0.1.0 layout was never released);
- private names (``_x``) are not imported across modules (PRIVATE_IMPORTS lists the exceptions, with
  their reason); notebooks use no private memlab name at all;
- a module passes MAX_MODULE_LINES, or a function MAX_FUNCTION_LINES, only with its reason below;
- every module has a docstring, and no docstring says ``Returns: None.``;
- CONTRIBUTING.md's map holds both ways: every path it names exists, and every module of memlab and
  every test folder is on it.
"""
from __future__ import annotations

import ast
import importlib
import json
import pathlib
import re
from collections import defaultdict

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "utils" / "memlab"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80

# module (relative to utils/memlab) -> why it may be longer: a class kept whole in its module
LONG_MODULES: dict[str, str] = {
    "profiler/tracker.py": "MemoryTracker whole: the class, the module frames it holds as an object (as PyTorch's "
                           "MemTracker holds a ModTracker) and its per-op helpers; split, it was three files of one class",
    "course/checks/ch05.py": "one module per lab, the learner's one file to read (issue 35): six exercises, each with its "
                             "drawn space, its reference and the empty-row cases of Lq > Lk under both alignments",
    "course/checks/ch07.py": "one module per lab (issue 35): 07.predict_peak's model of the step is the lecture's, "
                             "written out term by term so a learner can compare it with their own",
    "train/trainer.py": "BudgetTrainer whole: one object's loop, checkpoints and back-off share its state; split, it "
                        "would be mixins of one class",
    "estimate/validate.py": "the published figures, each with its source, setup and why it differs, beside the code "
                            "that traces them: the data is two thirds of it and reads as one table",
}
# "module:function" -> why it may be longer
LONG_FUNCTIONS: dict[str, str] = {
    "course/checks/ch05.py:check_chunked_forward": "the check a learner reads: the hand-picked cases (Lq > Lk empty "
                                                   "rows with their hint) in order, then the drawn space",
    "course/checks/ch05.py:check_flash_function": "the check a learner reads: what autograd may save, gradients, "
                                                  "then the drawn space, in one place",
    "profiler/tracker.py:__torch_dispatch__": "the tracker's per-op fast path, inlined on purpose: every helper call "
                                              "runs once per op of every traced step, and issue 42's overhead target "
                                              "(<= 1.2x the untracked step) is met only without them",
}

# The layers, bottom up. A module may import its own top-level package and any package of a lower
# layer; packages of one layer do not import each other.
LAYERS: list[set[str]] = [
    {"memlab"},  # the package root: its version, nothing imported
    {"core"},
    {"config"},
    {"models"},
    {"accounting", "profiler", "quant", "offload"},
    {"amp", "attention", "checkpoint", "distributed", "loss"},
    {"estimate"},
    {"plan", "testing"},
    {"train"},
    {"bench"},
    {"course"},
    {"cli"},
    {"__main__"},
]
LAYER = {name: i for i, layer in enumerate(LAYERS) for name in layer}

# "importer -> module.name" -> why a private name crosses a module boundary (none today)
PRIVATE_IMPORTS: dict[str, str] = {}

# the import paths of the unreleased 0.1.0 layout: gone, not shimmed
OLD_PATHS = ("memlab.grading", "memlab.checks", "memlab.labs", "memlab.doctor", "memlab.ckpt", "memlab.gpus",
             "memlab.attention_triton", "memlab._optional", "memlab.optional", "memlab.procs", "memlab.data",
             "memlab.timeline", "memlab.lora", "memlab.training_state", "memlab.adapters", "memlab.cuda_rules",
             "memlab.hub", "memlab.peers", "memlab.published_peaks", "memlab.cli_args")


def _modules() -> list[pathlib.Path]:
    return sorted(p for p in PKG.rglob("*.py") if "egg-info" not in str(p))


def _dotted(p: pathlib.Path) -> str:
    parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_dotted(p): p for p in _modules()}


def _top(dotted: str) -> str:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else "memlab"


def _resolve(name: str) -> str:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(path: pathlib.Path) -> list[tuple[str, str, int]]:
    """(imported module, imported name or '', line) for every memlab import of a file, lazy ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "memlab":
            for a in node.names:
                full = f"{node.module}.{a.name}"
                out.append((full if full in MODULES else _resolve(node.module), a.name, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(_resolve(a.name), "", node.lineno) for a in node.names if a.name.split(".")[0] == "memlab"]
    return out


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in MODULES.items():
        for target, _, _ in _imports(path):
            if target and target != name:
                graph[name].add(target)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for root in sorted(MODULES):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_circle_finder_finds_a_circle():
    graph = defaultdict(set, {"memlab.a": {"memlab.b"}, "memlab.b": {"memlab.c"}, "memlab.c": {"memlab.a"}})
    saved = dict(MODULES)
    try:
        MODULES.update({k: PKG for k in graph})
        assert ["memlab.a", "memlab.b", "memlab.c"] in _circles(graph)
    finally:
        MODULES.clear()
        MODULES.update(saved)


def test_no_import_circle():
    circles = _circles(_graph())
    assert not circles, f"import circles among memlab's modules (lazy imports count too): {circles}"


def test_every_package_has_a_layer():
    tops = {_top(name) for name in MODULES}
    assert tops <= set(LAYER), f"add these to LAYERS in tests/meta/test_layout.py: {sorted(tops - set(LAYER))}"


def test_no_upward_import():
    up = []
    for name, path in MODULES.items():
        src = _top(name)
        for target, _, line in _imports(path):
            dst = _top(target)
            if dst != src and LAYER[dst] >= LAYER[src]:
                up.append(f"{path.relative_to(PKG)}:{line} imports {target} ({dst} is not below {src})")
    assert not up, "imports that run up (or sideways) the layers:\n" + "\n".join(up)


def test_the_library_imports_neither_the_command_line_nor_the_course():
    bad = [f"{path.relative_to(PKG)}:{line} imports {target}" for name, path in MODULES.items()
           if _top(name) not in ("cli", "course", "__main__")
           for target, _, line in _imports(path) if _top(target) in ("cli", "course")]
    assert not bad, bad


def test_no_shim_module():
    shims = [str(p.relative_to(PKG)) for p in MODULES.values() if "sys.modules[__name__]" in p.read_text()]
    assert not shims, f"modules that stand in for another (shims): {shims}"


@pytest.mark.parametrize("old", OLD_PATHS)
def test_old_paths_are_gone(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_command_table_names_existing_modules():
    """The ``memlab`` command imports its sub-commands by name: each name is a module of memlab's cli/ or course/."""
    from memlab.cli import _COMMANDS

    for name, (module, func, _) in _COMMANDS.items():
        assert module in MODULES and _top(module) in ("cli", "course", "bench"), (name, module)


def _private_uses(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "memlab":
            private_mod = any(part.startswith("_") and not part.startswith("__") for part in node.module.split("."))
            out += [f"{node.module}.{a.name}" for a in node.names
                    if private_mod or (a.name.startswith("_") and not a.name.startswith("__"))]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.split(".")[0] == "memlab"
                    and any(x.startswith("_") and not x.startswith("__") for x in a.name.split("."))]
    return out


def test_private_names_stay_in_their_module():
    found = [f"{name} -> {use}" for name, path in MODULES.items()
             for use in _private_uses(ast.parse(path.read_text()))]
    unexplained = sorted(set(found) - set(PRIVATE_IMPORTS))
    assert not unexplained, f"private memlab names imported from another module (make them public): {unexplained}"
    assert len(found) <= 3, f"{len(found)} private cross-module imports; the layout allows at most 3"


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
        bad += _private_uses(tree)
        for node in ast.walk(tree):  # memlab.x._y
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                v, chain = node.value, []
                while isinstance(v, ast.Attribute):
                    chain.append(v.attr)
                    v = v.value
                if isinstance(v, ast.Name) and v.id == "memlab":
                    bad.append("memlab." + ".".join(reversed(chain)) + "." + node.attr)
    assert not bad, f"{nb.name} uses private memlab names: {bad}"


def test_no_module_over_the_line_limit():
    long = {str(p.relative_to(PKG)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES and str(p.relative_to(PKG)) not in LONG_MODULES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split along an idea, or say why in LONG_MODULES): {long}"
    stale = [m for m in LONG_MODULES if not (PKG / m).exists() or len((PKG / m).read_text().splitlines()) <= MAX_MODULE_LINES]
    assert not stale, f"LONG_MODULES entries no longer needed: {stale}"


def test_no_function_over_the_line_limit():
    long = {}
    for p in MODULES.values():
        rel = str(p.relative_to(PKG))
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES and f"{rel}:{node.name}" not in LONG_FUNCTIONS:
                    long[f"{rel}:{node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them, or say why in LONG_FUNCTIONS): {long}"


def test_every_module_has_a_docstring():
    bare = [str(p.relative_to(PKG)) for p in MODULES.values()
            if p.read_text().strip() and not ast.get_docstring(ast.parse(p.read_text()))]
    assert not bare, f"modules without a docstring (what it holds, the paper, the formula): {bare}"


_CEREMONY = re.compile(r"Returns:\s*\n\s*None\.?\s*(\n|$)")


def test_no_docstring_ceremony():
    """``Returns: None.`` says nothing the signature does not: leave the section out."""
    found = []
    for p in MODULES.values():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
                doc = ast.get_docstring(node) or ""
                if _CEREMONY.search(doc):
                    found.append(f"{p.relative_to(PKG)}:{getattr(node, 'name', '<module>')}")
    assert not found, f"docstrings with 'Returns: None.': {found}"


# ---------------------------------------------------------------- CONTRIBUTING.md's map, both ways
def _map_rows() -> list[list[str]]:
    text = (ROOT / "CONTRIBUTING.md").read_text()
    section = text[text.index("## The map"):]
    section = section[: section.index("\n## ", 4)] if "\n## " in section[4:] else section
    return [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in section.splitlines()
            if ln.startswith("|") and not set(ln) <= set("|- ") and not ln.startswith("| ch ")
            and not ln.startswith("| part ")]


def _code_paths(cell: str) -> list[str]:
    """``a.py``, ``pkg/`` and ``pkg/`` (``x.py``, ``y.py``) -> paths relative to utils/memlab; a folder
    with no file list stands for every module in it."""
    out = []
    for pkg, inner in re.findall(r"`([\w/]+/)`(?:\s*\(([^)]*)\))?", cell):
        files = re.findall(r"`([\w/.]+\.(?:py|cpp))`", inner or "")
        out += [pkg + f for f in files] if files else [pkg]
    rest = re.sub(r"`[\w/]+/`\s*\([^)]*\)", "", cell)
    out += re.findall(r"`([\w/.]+\.py)`", rest)
    return out


def _map() -> tuple[list[str], list[str]]:
    code, tests = [], []
    for cells in _map_rows():
        assert len(cells) >= 3, f"a row of CONTRIBUTING.md's map has too few cells: {cells}"
        code += _code_paths(cells[1])
        tests += re.findall(r"`(tests/[\w/.]+)`", cells[2])
    return code, tests


def test_contributing_map_names_existing_paths():
    code, tests = _map()
    missing = [f"utils/memlab/{c}" for c in code if not (PKG / c).exists()]
    missing += [t for t in tests if not (ROOT / t).exists()]
    for cells in _map_rows():
        if re.fullmatch(r"0\d", cells[0]):
            chapter = cells[0]
            for col, where in ((3, PKG / "course" / "checks"), (4, ROOT / "tests" / "course" / "mutants")):
                missing += [str(where / n) for n in re.findall(r"`(ch\d\d\.py)`", cells[col]) if not (where / n).exists()]
            assert f"ch{chapter}.py" in cells[3], f"chapter {chapter}'s row names its checks module"
    assert not missing, f"CONTRIBUTING.md's map names paths that do not exist: {missing}"


def test_every_module_and_test_folder_is_on_the_map():
    code, tests = _map()
    covered = set()
    for c in code:
        target = PKG / c
        covered |= {p for p in target.rglob("*.py")} if target.is_dir() else {target}
    skip = {"__init__.py", "__main__.py"}
    off = [str(p.relative_to(PKG)) for p in MODULES.values() if p.name not in skip and p not in covered]
    assert not off, f"modules missing from CONTRIBUTING.md's map: {off}"
    folders = {d for d in (ROOT / "tests").iterdir() if d.is_dir() and not d.name.startswith((".", "_"))}
    named = {(ROOT / t) for t in tests}
    off_tests = sorted(str(d.relative_to(ROOT)) + "/" for d in folders if d not in named)
    assert not off_tests, f"test folders missing from CONTRIBUTING.md's map: {off_tests}"
    loose = sorted(p.name for p in (ROOT / "tests").glob("test_*.py"))
    assert not loose, f"tests belong in a folder of the map, not at tests/'s top: {loose}"
