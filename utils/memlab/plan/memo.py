"""A whole plan, remembered: a repeated :func:`memlab.plan.plan` with the same arguments (and the same memlab
source, torch and transformers versions) reads its :class:`~memlab.plan.result.PlanResult` from disk instead of
searching again -- without importing torch or transformers, so a repeated ``memlab plan`` answers in about a
second.

The file sits next to the trace cache (:func:`memlab.plan.stacks.trace_cache_dir`, under ``plans/``; none
when that cache is off), keyed by every argument that shapes the plan: the model (a preset's name, a config
file's bytes, a transformers config's JSON; a Hub id is not remembered, its config can change), the budget,
card, batch, sequence, ``allow``, device, ``top``, ranking, cost constants, LoRA rank, loss, pruning and host
budget; by ``CUBLAS_WORKSPACE_CONFIG``; and by the source of every memlab module and the versions of torch,
transformers, peft and bitsandbytes. The host budget
``"auto"`` (this machine's available memory) changes from run to run: the plan keeps each host size its search
compared with the host budget, and is read back only when each comparison comes out the same with today's
budget (so it would have searched the same way).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
from pathlib import Path
from typing import Any

from memlab.core.cachefile import write_cache_file

_SOURCE: list[str] = []


def _source_hash() -> str:
    # every memlab module and the versions of torch and transformers, none of them imported
    if not _SOURCE:
        import importlib.metadata as md

        h = hashlib.sha256()
        here = Path(__file__).resolve().parents[1]
        for f in sorted(here.rglob("*.py")):
            h.update(str(f.relative_to(here)).encode() + f.read_bytes())
        for dist in ("torch", "transformers", "peft", "bitsandbytes"):
            try:
                h.update(f"{dist} {md.version(dist)}".encode())
            except md.PackageNotFoundError:
                h.update(f"{dist} -".encode())
        _SOURCE.append(h.hexdigest()[:20])
    return _SOURCE[0]


def _model_key(model: Any) -> str | None:
    if isinstance(model, str):
        if os.path.exists(model):
            path = os.path.join(model, "config.json") if os.path.isdir(model) else model
            try:
                data = Path(path).read_bytes()
            except OSError:
                return None
            return f"file {os.path.abspath(model)} {hashlib.sha256(data).hexdigest()}"
        if "/" in model or os.sep in model or model.endswith(".json"):
            return None  # a Hub id (its config can change upstream) or a path that is not there (an error)
        return f"preset {model}"
    if hasattr(model, "to_json_string"):
        return f"config {type(model).__name__} {model.to_json_string(use_diff=False)}"
    return None


def plan_key(model: Any, arguments: dict[str, Any]) -> str | None:
    """The plan cache's key for ``model`` and :func:`memlab.plan.plan`'s other ``arguments`` (a dict), or None where
    the plan is not remembered (a Hub id, a callable, the cache off)."""
    from memlab.plan.stacks import trace_cache_dir

    mk = _model_key(model)
    if mk is None or trace_cache_dir() is None:
        return None
    args = dict(arguments)
    allow = args.pop("allow", None)
    args["allow"] = None if allow is None else sorted((str(k), repr(v)) for k, v in dict(allow).items())
    overrides = args.pop("config_overrides", None)
    args["config_overrides"] = None if overrides is None else sorted((str(k), repr(v)) for k, v in dict(overrides).items())
    env = os.environ.get("CUBLAS_WORKSPACE_CONFIG")  # the cuBLAS workspaces of a CUDA target's reserved estimate
    text = repr((mk, sorted((k, repr(v)) for k, v in args.items()), env, _source_hash()))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _path(key: str) -> Path | None:
    from memlab.plan.stacks import trace_cache_dir

    d = trace_cache_dir()
    return None if d is None else d / "plans" / f"{key}.pkl"


def load(key: str | None, host_budget: int | None) -> Any:
    """The remembered :class:`~memlab.plan.result.PlanResult` of ``key``, or None (none, unreadable, or a host budget
    that would have changed one of its comparisons)."""
    path = _path(key) if key else None
    if path is None or not path.exists():
        return None
    try:
        with open(path, "rb") as f:
            saved = pickle.load(f)
        result, compared, old = saved["result"], saved["host_compared"], saved["host_budget"]
    except Exception:  # noqa: BLE001  (a torn or stale file: plan again)
        return None
    if any((h > old if old is not None else False) != (h > host_budget if host_budget is not None else False)
           for h in compared):
        return None
    return result


def save(key: str | None, result: Any, host_compared: list[int], host_budget: int | None) -> None:
    """Remember ``result`` under ``key`` with the host sizes its search compared with ``host_budget``; the
    cache is a speed-up only, so a failure to write is silent."""
    path = _path(key) if key else None
    if path is None:
        return
    write_cache_file(path, dict(result=dataclasses.replace(result), host_compared=list(host_compared),
                                host_budget=host_budget))
