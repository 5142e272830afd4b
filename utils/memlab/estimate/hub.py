"""Hugging Face Hub model names for the estimator: ``memlab estimate meta-llama/Llama-3.1-8B``.

Only the model's ``config.json`` is read, through transformers' own config loading
(``AutoConfig.from_pretrained``): its cache (``HF_HOME`` / ``HF_HUB_CACHE``), its offline switch
(``HF_HUB_OFFLINE=1``) and its login for gated models. No weights are downloaded: the estimator builds
the model on fake tensors from the config alone. ``trust_remote_code`` is never set: a model whose
config class lives in its repository is refused (download its config.json and pass a supported
``model_type``, or a preset).

Offline (or without network) and with no cached copy the answer is one line naming the routes that
work without the Hub: a preset, or the path of a ``config.json``.
"""
from __future__ import annotations

import os
import re
import warnings
from typing import Any

__all__ = ["looks_like_repo_id", "load_hub_config", "HubConfigError"]

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")


class HubConfigError(ValueError):
    """A Hub model id whose config.json cannot be had (offline, no cache, gated, unknown)."""


def looks_like_repo_id(name: Any) -> bool:
    """Whether ``name`` is a Hub model id: ``"org/name"`` that is not a path that exists and not a file
    name ending in .json."""
    return (isinstance(name, str) and bool(_REPO_ID.match(name)) and not name.endswith(".json")
            and not os.path.exists(name))


def _truthy(v: str | None) -> bool:
    return (v or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _offline() -> bool:
    try:
        from huggingface_hub import constants

        if getattr(constants, "HF_HUB_OFFLINE", False):
            return True
    except Exception:  # pragma: no cover
        pass
    return _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get("TRANSFORMERS_OFFLINE"))


def _cache_dir() -> str | None:
    """The hub cache as the environment says now (HF_HUB_CACHE, else HF_HOME/hub); None: the library's default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None


def load_hub_config(repo_id: str, revision: str | None = None) -> Any:
    """The transformers config of a Hub model (its config.json only, through transformers' cache).

    ``revision``: a branch, tag or commit (default: main).

    Raises:
        HubConfigError: in one line, naming the routes that work without the Hub (a preset, a config.json path).
    """
    from memlab.models import PRESETS

    offline = _offline()
    try:
        from transformers import AutoConfig

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoConfig.from_pretrained(repo_id, revision=revision, cache_dir=_cache_dir(),
                                              local_files_only=offline, trust_remote_code=False)
    except Exception as exc:  # OSError (not cached / not found / gated), ValueError (remote code, unknown type)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        where = ("offline (HF_HUB_OFFLINE=1) with no cached copy" if offline
                 else f"config.json could not be read ({type(exc).__name__}: {first})")
        raise HubConfigError(
            f"model={repo_id!r}: {where}; allowed: a preset ({', '.join(sorted(PRESETS))}), the path of a "
            f"config.json (e.g. download https://huggingface.co/{repo_id}/resolve/main/config.json and pass its path), "
            f"or a Hub id whose config.json is in the cache ({_cache_dir() or 'the default HF cache'})"
        ) from None
