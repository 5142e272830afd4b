"""Every optional dependency of memlab, when missing, is one line naming the extra to install:
from the library (``MissingExtraError``) and from the ``memlab`` command (that line, exit 2, no
traceback). A missing package is simulated with ``sys.modules[name] = None`` in a subprocess."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from memlab.core import optional
from memlab.core.optional import EXTRAS, MissingExtraError, needs, require_installed

ROOT = Path(__file__).resolve().parents[2]
LAB = "labs/00_where_the_memory_goes.ipynb"


def _run_without(modules: list[str], code: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter in which every name in ``modules`` cannot be imported. The trace cache is
    off: an estimate the user's cache holds is answered without transformers (a run of `memlab estimate llama-2-7b`
    on the same machine before made this test's estimate exit 0)."""
    import os

    prelude = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules)
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MEMLAB_CACHE_DIR": "none"},
    )


@pytest.mark.parametrize("module, extra", sorted(EXTRAS.items()))
def test_needs_names_the_extra_of_every_optional_module(monkeypatch, module, extra):
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(MissingExtraError) as info:
        with needs("memlab demo"):
            __import__(module)
    assert str(info.value) == f"memlab demo needs {module}: pip install 'memlab[{extra}]'"
    assert isinstance(info.value, ImportError) and info.value.name == module
    with pytest.raises(MissingExtraError, match=rf"memlab demo needs {module}: pip install 'memlab\[{extra}\]'"):
        require_installed(module, "memlab demo")


def test_needs_leaves_other_import_errors_alone(monkeypatch):
    monkeypatch.setitem(sys.modules, "not_an_extra_xyz", None)
    with pytest.raises(ModuleNotFoundError) as info:
        with needs("memlab demo"):
            import not_an_extra_xyz  # noqa: F401
    assert not isinstance(info.value, MissingExtraError)
    with pytest.raises(ValueError, match="module='numpy' is not an optional dependency"):
        require_installed("numpy", "memlab demo")


def test_extras_match_pyproject():
    import tomllib

    project = tomllib.loads((ROOT / "utils" / "pyproject.toml").read_text())["project"]
    for module, extra in EXTRAS.items():
        if module == "jupyter_client":  # comes with nbclient
            continue
        names = [req.split(";")[0].split(">")[0].split("=")[0].strip() for req in project["optional-dependencies"][extra]]
        assert module in names, (module, extra, names)


@pytest.mark.parametrize(
    "missing, argv, line",
    [
        ("transformers", ["estimate", "llama-2-7b"], "memlab estimate needs transformers: pip install 'memlab[hf]'"),
        ("nbformat", ["grade", LAB], "memlab grade needs nbformat: pip install 'memlab[grade]'"),
        ("jupyter_client", ["grade", LAB], "memlab grade needs jupyter_client: pip install 'memlab[grade]'"),
        ("ipykernel", ["grade", LAB], "memlab grade needs ipykernel: pip install 'memlab[grade]'"),
        ("nbformat", ["labs", "check"], "memlab labs needs nbformat: pip install 'memlab[grade]'"),
    ],
    ids=["estimate-transformers", "grade-nbformat", "grade-jupyter_client", "grade-ipykernel", "labs-nbformat"],
)
def test_cli_prints_one_line_and_exits_2(missing, argv, line):
    proc = _run_without([missing], f"from memlab.cli import main\nsys.exit(main({argv!r}))")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == line, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "call, feature",
    [
        ("from memlab.models import tiny_llama; tiny_llama()", "memlab.models.tiny_llama"),
        ("from memlab.models import tiny_llama_config; tiny_llama_config()", "memlab.models.tiny_llama_config"),
        ("from memlab.models import preset_config; preset_config('gpt2')", "memlab.models.preset_config"),
        ("from memlab.estimate import estimate_training_memory; estimate_training_memory('gpt2', batch_size=1, seq_len=8)", "memlab.models.preset_config"),
    ],
)
def test_library_raises_one_line_import_error(call, feature):
    code = f"""
        from memlab.core.optional import MissingExtraError
        try:
            {call}
        except MissingExtraError as exc:
            print(exc)
        """
    proc = _run_without(["transformers"], code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{feature} needs transformers: pip install 'memlab[hf]'"


def test_core_imports_without_any_extra():
    """``import memlab`` and its core modules need none of the extras."""
    proc = _run_without(
        sorted(EXTRAS),
        "import memlab, memlab.config, memlab.models, memlab.estimate, memlab.course.labs, memlab.cli\n"
        "from memlab.models import TinyGPT, TinyGPTConfig\nprint('ok')",
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_missing_optional_ignores_submodules_of_installed_packages():
    exc = ModuleNotFoundError("No module named 'transformers.nope'", name="transformers.nope")
    assert optional.missing_optional(exc) is None  # transformers is installed: a broken install, not a missing extra
