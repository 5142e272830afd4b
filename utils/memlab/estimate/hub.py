"""Hugging Face Hub model names for the estimator: ``memlab estimate meta-llama/Llama-3.1-8B``.

Only the model's ``config.json`` is read, through transformers' own config loading
(``AutoConfig.from_pretrained``): its cache (``HF_HOME`` / ``HF_HUB_CACHE``), its offline switch
(``HF_HUB_OFFLINE=1``) and its login for gated models. No weights are downloaded: the estimator builds
the model on fake tensors from the config alone. ``trust_remote_code`` is never set: a model whose
config class lives in its repository is refused (download its config.json and pass a supported
``model_type``, or a preset).

Before the Hub client is called, whether the Hub (``HF_ENDPOINT``, or the proxy of ``HTTPS_PROXY``) can be
reached is checked once per process, with one TCP connection of at most :data:`CONNECT_TIMEOUT_S` seconds
(name resolution included); unreachable, the client reads the cache only (``local_files_only``), so an
offline machine answers in about a second instead of spending tens of seconds in the client's retries.
Offline (or without network) and with no cached copy the answer is one line naming the nearest preset
(:func:`nearest_preset`) and the routes that work without the Hub: a preset, or the path of a ``config.json``.
A config read once is kept for the process (a copy is returned each time).
"""
from __future__ import annotations

import copy
import difflib
import os
import re
import socket
import threading
import warnings
from typing import Any
from urllib.parse import urlparse

__all__ = ["looks_like_repo_id", "load_hub_config", "HubConfigError", "nearest_preset", "hub_reachable", "REPO_ID"]

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
CONNECT_TIMEOUT_S = 1.0  # one TCP connection to the Hub (or the proxy), name resolution included
_CACHE: dict[tuple[str, str | None, str | None], Any] = {}
_REACHABLE: dict[tuple[str, int], bool] = {}


class HubConfigError(ValueError):
    """A Hub model id whose config.json cannot be had (offline, no cache, gated, unknown)."""


def looks_like_repo_id(name: Any) -> bool:
    """Whether ``name`` is a Hub model id: ``"org/name"`` that is not a path that exists and not a file
    name ending in .json."""
    return (isinstance(name, str) and bool(REPO_ID.match(name)) and not name.endswith(".json")
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


def _hub_address() -> tuple[str, int]:
    # where a request to the Hub first goes: the HTTPS proxy if one is set, else HF_ENDPOINT (huggingface.co)
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    url = urlparse(proxy if proxy else os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    default = 443 if url.scheme == "https" else 80
    try:
        port = url.port or default
    except ValueError:
        port = default
    return url.hostname or "huggingface.co", port


def hub_reachable(timeout: float = CONNECT_TIMEOUT_S) -> bool:
    """Whether one TCP connection to the Hub (or the HTTPS proxy) opens within ``timeout`` seconds, name
    resolution included (run in a daemon thread, so a resolver that hangs cannot hold the caller). The answer is
    kept for the process."""
    address = _hub_address()
    if address in _REACHABLE:
        return _REACHABLE[address]
    result: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection(address, timeout=timeout):
                result.append(True)
        except OSError:
            result.append(False)

    t = threading.Thread(target=probe, daemon=True, name="memlab-hub-probe")
    t.start()
    t.join(timeout + 0.1)
    _REACHABLE[address] = bool(result and result[0])
    return _REACHABLE[address]


def _normal(name: str) -> str:
    # a model name without its organisation, case, punctuation and the usual suffixes: "Llama-3.1-8B" -> "llama318b"
    base = name.rsplit("/", 1)[-1].lower()
    base = re.sub(r"[-_.](hf|base)$", "", base)
    return re.sub(r"[^a-z0-9]", "", base.replace("meta-llama", "llama").replace("meta-", ""))


def nearest_preset(repo_id: str) -> str | None:
    """The preset of :data:`memlab.models.PRESETS` nearest to a Hub id: the preset whose ``hf_id`` it is, else
    the closest by :mod:`difflib` over normalised names (organisation, case and punctuation dropped: ``meta-llama/
    Llama-3.1-8B`` -> ``llama-3-8b``), None when nothing is close."""
    from memlab.models import PRESETS

    by_id = {str(e.get("hf_id", "")).lower(): name for name, e in PRESETS.items()}
    if repo_id.lower() in by_id:
        return by_id[repo_id.lower()]
    names: dict[str, str] = {}
    for name, e in PRESETS.items():
        names.setdefault(_normal(name), name)
        if e.get("hf_id"):
            names.setdefault(_normal(str(e["hf_id"])), name)
    close = difflib.get_close_matches(_normal(repo_id), list(names), n=1, cutoff=0.6)
    return names[close[0]] if close else None


def _cached(repo_id: str, revision: str | None) -> bool:
    """Whether the Hub cache holds this model's config.json (huggingface_hub's own lookup, no request)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json", cache_dir=_cache_dir(), revision=revision), str)
    except Exception:  # noqa: BLE001  (an older huggingface_hub: let transformers look)
        return True


def load_hub_config(repo_id: str, revision: str | None = None) -> Any:
    """The transformers config of a Hub model (its config.json only, through transformers' cache).

    ``revision``: a branch, tag or commit (default: main). Offline, or with the Hub unreachable
    (:func:`hub_reachable`), only the cache is read: no retries.

    Raises:
        HubConfigError: in one line, naming the nearest preset and the routes that work without the Hub (a
            preset, a config.json path).
    """
    from memlab.models import PRESETS

    key = (repo_id, revision, _cache_dir())
    if key in _CACHE:
        return copy.deepcopy(_CACHE[key])
    offline = _offline()
    unreachable = not offline and not hub_reachable()
    try:
        if (offline or unreachable) and not _cached(repo_id, revision):
            raise OSError("no cached config.json")  # said at once: transformers' import alone takes seconds
        from transformers import AutoConfig

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = AutoConfig.from_pretrained(repo_id, revision=revision, cache_dir=_cache_dir(),
                                             local_files_only=offline or unreachable, trust_remote_code=False)
    except Exception as exc:  # OSError (not cached / not found / gated), ValueError (remote code, unknown type)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        host, port = _hub_address()
        where = ("offline (HF_HUB_OFFLINE=1) with no cached copy" if offline
                 else f"the Hub ({host}:{port}) cannot be reached and no copy is cached" if unreachable
                 else f"config.json could not be read ({type(exc).__name__}: {first})")
        near = nearest_preset(repo_id)
        hint = f"; nearest preset: {near} (memlab estimate {near})" if near else ""
        raise HubConfigError(
            f"model={repo_id!r}: {where}{hint}; allowed: a preset ({', '.join(sorted(PRESETS))}), the path of a "
            f"config.json (e.g. download https://huggingface.co/{repo_id}/resolve/main/config.json and pass its path), "
            f"or a Hub id whose config.json is in the cache ({_cache_dir() or 'the default HF cache'})"
        ) from None
    _CACHE[key] = cfg
    return copy.deepcopy(cfg)
