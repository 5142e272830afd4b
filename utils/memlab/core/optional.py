"""Optional dependencies: one line that names the extra to install, never a raw traceback.

memlab's core needs only torch, numpy, matplotlib and tqdm. Everything else comes with an
extra of the ``memlab`` distribution (see ``utils/pyproject.toml``):

* ``hf``: transformers, peft, accelerate, bitsandbytes (models, presets, ``memlab estimate``);
* ``grade``: nbformat, nbclient, jupyter_client, ipykernel (``memlab grade``, ``memlab labs``).

An import site wraps its import in :func:`needs`::

    with needs("memlab estimate"):
        from transformers import AutoConfig

and a missing package then raises :class:`MissingExtraError`, an ``ImportError`` whose message is
one line: ``memlab estimate needs transformers: pip install 'memlab[hf]'``. The ``memlab`` command
prints that line and exits 2.
"""
from __future__ import annotations

import contextlib
import importlib.util
from typing import Any, Iterator

__all__ = ["EXTRAS", "MissingExtraError", "needs", "require_installed", "extra_for", "missing_optional",
           "lazy_attributes"]

#: top-level module -> the extra of ``memlab`` that installs it
EXTRAS: dict[str, str] = {
    "transformers": "hf",
    "peft": "hf",
    "accelerate": "hf",
    "bitsandbytes": "hf",
    "datasets": "hf",
    "nbformat": "grade",
    "nbclient": "grade",
    "jupyter_client": "grade",
    "ipykernel": "grade",
}


def extra_for(module: str) -> str | None:
    """The extra that installs ``module``'s top-level package (``"transformers.models"`` ->
    ``"hf"``), or None when it is not an optional dependency."""
    return EXTRAS.get(module.split(".")[0])


class MissingExtraError(ImportError):
    """An optional package is missing. ``str(exc)`` is one line naming what needed it, the
    package and the extra to install; ``module``, ``extra`` and ``feature`` hold the parts."""

    def __init__(self, feature: str, module: str, extra: str) -> None:
        self.feature, self.module, self.extra = feature, module, extra
        super().__init__(f"{feature} needs {module}: pip install 'memlab[{extra}]'", name=module)

    def for_feature(self, feature: str) -> "MissingExtraError":
        """A new error for the same module and extra, worded for another ``feature`` (the CLI
        names its command)."""
        return MissingExtraError(feature, self.module, self.extra)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a None entry in sys.modules, or a broken parent package
        return False


def missing_optional(exc: BaseException) -> str | None:
    """The optional top-level module whose absence ``exc`` reports (``"transformers"``), or None
    when ``exc`` (the exception an import raised) is about something else: a broken install
    still shows its own error."""
    name = getattr(exc, "name", None)
    if not isinstance(exc, ModuleNotFoundError) or not name:
        return None
    top = name.split(".")[0]
    if top not in EXTRAS:
        return None
    return top if name == top or not _installed(top) else None


@contextlib.contextmanager
def needs(feature: str) -> Iterator[None]:
    """Turn a missing optional package imported inside the block into :class:`MissingExtraError`.

    ``feature`` names what needs it, as the learner would call it (``"memlab estimate"``,
    ``"memlab.models.tiny_llama"``). Other import errors pass through unchanged.

    Raises:
        MissingExtraError: naming ``feature``, the missing module and the extra that installs it.
    """
    try:
        yield
    except MissingExtraError:
        raise
    except ModuleNotFoundError as exc:
        module = missing_optional(exc)
        if module is None:
            raise
        raise MissingExtraError(feature, module, EXTRAS[module]) from None


def require_installed(module: str, feature: str) -> None:
    """Raise :class:`MissingExtraError` when optional ``module`` cannot be imported, without
    importing it (for packages another process imports, e.g. ipykernel for the grading kernel).
    ``feature`` names what needs it, for the message.

    Raises:
        ValueError: ``module`` is not an optional dependency.
        MissingExtraError: ``module`` is not installed.
    """
    extra = extra_for(module)
    if extra is None:
        raise ValueError(f"module={module!r} is not an optional dependency; allowed: {', '.join(EXTRAS)}")
    if not _installed(module):
        raise MissingExtraError(feature, module, extra)


def lazy_attributes(package: str, where: dict[str, str], namespace: dict) -> tuple[Any, Any]:
    """A package's PEP 562 ``__getattr__`` and ``__dir__``: a public name in ``where`` (name -> module) is imported
    from its module when first used, any other name as a submodule (``memlab.estimate.trace``), and kept in
    ``namespace`` (the package's globals) after. ``__getattr__, __dir__ = lazy_attributes(__name__, _WHERE,
    globals())``: importing the package imports none of its modules (no torch, no transformers)."""
    import importlib

    def __getattr__(name: str) -> Any:
        if name in where:
            value = getattr(importlib.import_module(where[name]), name)
        elif not name.startswith("__"):
            try:
                value = importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__
