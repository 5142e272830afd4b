"""What a BudgetTrainer checkpoint must hold before anything is loaded from it, and whose it is.

A checkpoint file that verifies (:mod:`memlab.train.state`: layout and SHA-256) can still be unfit
to resume: written by hand or by another tool, or by a run of another model. :func:`check_trainer_state`
reads the whole state tree against the trainer that would load it, before the trainer changes
anything, and sorts what is wrong into two kinds:

* **malformed** (:class:`~memlab.train.state.CheckpointError`): a field of the wrong type or shape
  (the step, the losses, the stack, the back-offs, an optimizer moment of another shape than its
  parameter, an RNG state the generators refuse). The trainer skips such a file and resumes from
  the newest checkpoint that passes, as it does for a file that fails its checksum.
* **another run's** (:class:`ForeignCheckpointError`): a valid state of another model -- its config
  (:func:`model_config`: the class and the config's fields, so a 4-head model is told from a 2-head
  model with the same tensor shapes), its tensor names or shapes -- or of another
  ``effective_batch``/``seq_len``/``seed``. The trainer refuses the directory, in one line naming the
  difference: resuming someone else's run is a mistake to report, not a fault to route around.
"""
from __future__ import annotations

import dataclasses
import math
import random
import sys
from typing import Any

import torch
from torch import nn

from memlab.plan import Stack
from memlab.train.stacks import Backoff
from memlab.train.state import CheckpointError

__all__ = ["FORMAT", "ForeignCheckpointError", "model_config", "config_difference", "check_trainer_state"]

FORMAT = "memlab.train/1"  # a BudgetTrainer state's "format"
_FIX = "use another ckpt_dir, or fresh=True (--fresh) to set its checkpoints aside"
# config fields that do not change what the model computes (names, versions, output switches, the attention
# kernel that each stack sets, the dtype a model was loaded in, the initialisation a checkpoint overwrites)
_NOT_THE_FUNCTION = frozenset({
    "attention", "attn_implementation", "transformers_version", "architectures", "output_hidden_states",
    "output_attentions", "return_dict", "use_return_dict", "dtype", "torch_dtype", "use_cache", "id2label",
    "label2id", "problem_type", "chunk_size_feed_forward", "tokenizer_class", "task_specific_params",
    "finetuning_task", "torchscript", "initializer_range", "name_or_path"})


_FLAGS = ("amsgrad", "maximize", "foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay")


class ForeignCheckpointError(CheckpointError):
    """A checkpoint that verifies but is another run's: another model (config, tensors) or other data settings."""


# ----------------------------------------------------------------------------- the model's config
def _plain(v: Any) -> Any:
    # A JSON-able copy of a config value (tuples become lists, dict keys strings, other objects their repr).
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else repr(v)
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return repr(v)


def model_config(model: nn.Module) -> dict[str, Any]:
    """What tells one model from another beyond its tensor shapes, as plain values: ``class`` (module and
    name) and the fields of ``model.config`` (a dataclass such as :class:`memlab.models.TinyGPTConfig`, or
    a ``transformers`` config's ``to_dict()``), without those that do not change the function it computes
    (names, versions, the attention kernel, the load dtype, the initialisation)."""
    cls = type(model)
    out: dict[str, Any] = {"class": f"{cls.__module__}.{cls.__qualname__}"}
    cfg = getattr(model, "config", None)
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    elif callable(getattr(cfg, "to_dict", None)):
        fields = cfg.to_dict()
    else:
        fields = {}
    for k in sorted(k for k in fields if isinstance(k, str)):
        if not k.startswith("_") and k not in _NOT_THE_FUNCTION:
            out[k] = _plain(fields[k])
    return out


def config_difference(saved: dict[str, Any], mine: dict[str, Any], limit: int = 4) -> str | None:
    """``None`` when the two :func:`model_config` dicts agree, else the differing fields in words:
    ``n_head=4 in the checkpoint, n_head=2 in this model`` (up to ``limit`` of them)."""
    absent = "<absent>"
    keys = [k for k in sorted(set(saved) | set(mine), key=str)  # compared as plain values: a tensor equals nothing
            if _plain(saved.get(k, absent)) != _plain(mine.get(k, absent))]
    if not keys:
        return None
    parts = [f"{k}={_brief(saved.get(k, absent))} in the checkpoint, {k}={_brief(mine.get(k, absent))} "
             "in this model" for k in keys[:limit]]
    more = f" (and {len(keys) - limit} more)" if len(keys) > limit else ""
    return "; ".join(parts) + more


def _brief(v: Any) -> str:
    text = repr(v) if not isinstance(v, str) or v != "<absent>" else v
    return text if len(text) <= 60 else text[:57] + "..."


# ----------------------------------------------------------------------------- the state, field by field
def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _finite(x: Any) -> bool:  # a number a float holds (a JSON int may have thousands of digits)
    return _number(x) and x == x and abs(x) <= sys.float_info.max


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def check_trainer_state(state: Any, *, model: nn.Module, effective_batch: int, seq_len: int, seed: int,
                        where: Any = None) -> None:
    """Check a loaded checkpoint tree against the trainer that would resume it, before anything is loaded;
    ``where`` (the file) names it in the messages.

    Raises:
        ForeignCheckpointError: not a BudgetTrainer state, or one of another model or data settings.
        CheckpointError: a BudgetTrainer state with a malformed field.
    """
    try:
        _check_state(state, model, effective_batch, seq_len, seed, where)
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError, RecursionError,
            RuntimeError) as exc:  # RuntimeError: torch's, e.g. the truth value of a tensor put where a number was
        # a crafted state this check did not foresee field by field: malformed all the same
        raise CheckpointError(f"{where}: malformed BudgetTrainer checkpoint ({type(exc).__name__}: "
                              f"{str(exc)[:160]}); {_FIX}") from None


def _check_state(state: Any, model: nn.Module, effective_batch: int, seq_len: int, seed: int, where: Any) -> None:
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        what = (f"format={_brief(state.get('format'))}" if isinstance(state, dict)
                else f"its state is a {type(state).__name__}")
        raise ForeignCheckpointError(f"{where}: not a BudgetTrainer checkpoint ({what}, expected {FORMAT!r}); {_FIX}")

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{where}: malformed BudgetTrainer checkpoint: {why}; {_FIX}")

    need = {"step": int, "losses": list, "step_peaks": list, "stack": dict, "backoffs": list, "data": dict,
            "model": dict, "optimizer": dict, "rng": dict, "model_config": dict}
    for key, typ in need.items():
        v = state.get(key)
        if not isinstance(v, typ) or isinstance(v, bool):
            raise bad(f"{key!r} is {type(v).__name__}, expected {typ.__name__}")
    _check_run(state, where, model, effective_batch, seq_len, seed)
    step, losses, peaks = state["step"], state["losses"], state["step_peaks"]
    if not (0 <= step == len(losses) == len(peaks)):
        raise bad(f"step={step} with {len(losses)} losses and {len(peaks)} step peaks")
    if not all(isinstance(x, float) or _finite(x) for x in losses) or not all(_count(x) for x in peaks):
        raise bad("losses must be numbers and step_peaks ints >= 0")
    try:
        Stack(**state["stack"])
        for b in state["backoffs"]:
            Backoff.from_json(b)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        raise bad(f"stack or back-offs ({type(exc).__name__}: {str(exc)[:160]})") from None
    _check_optimizer(state["optimizer"], model, bad)
    _check_rng(state["rng"], bad)


def _check_run(state: dict[str, Any], where: Any, model: nn.Module, effective_batch: int, seq_len: int,
               seed: int) -> None:
    # Another run's state: other data settings, another model's config, tensor names or shapes.
    data = state["data"]
    got = tuple(data.get(k) for k in ("effective_batch", "seq_len", "seed"))
    if _plain(list(got)) != [effective_batch, seq_len, seed]:
        raise ForeignCheckpointError(
            f"{where}: checkpoint of effective_batch={got[0]}, seq_len={got[1]}, seed={got[2]}; this trainer "
            f"has {effective_batch}, {seq_len}, {seed}; {_FIX}")
    diff = config_difference(state["model_config"], model_config(model))
    if diff is not None:
        raise ForeignCheckpointError(f"{where}: checkpoint of another model config: {diff}; {_FIX}")
    mine, theirs = model.state_dict(), state["model"]
    missing, extra = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine), key=repr)
    if missing or extra:
        raise ForeignCheckpointError(f"{where}: checkpoint of another model (missing tensors {missing[:3]}, "
                                     f"unexpected {extra[:3]}); {_FIX}")
    for k, v in mine.items():
        t = theirs[k]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(v.shape):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ForeignCheckpointError(f"{where}: checkpoint of another model shape: {k} is {shape} there, "
                                         f"{tuple(v.shape)} in this model; {_FIX}")


def _check_optimizer(sd: dict[str, Any], model: nn.Module, bad: Any) -> None:
    # A whole-model AdamW state_dict over the model's trainable parameters, numbered in parameters() order.
    params = [p for p in model.parameters() if p.requires_grad]
    groups, per_param = sd.get("param_groups"), sd.get("state")
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups) \
            or not isinstance(per_param, dict):
        raise bad("the optimizer state needs 'state' (a dict) and 'param_groups' (a non-empty list of dicts)")
    ids = [i for g in groups for i in (g.get("params") if isinstance(g.get("params"), list) else [None])]
    if not all(_count(i) for i in ids) or sorted(ids) != list(range(len(params))):
        raise bad(f"the optimizer's param_groups number {len(ids)} parameters ({str(ids)[:60]}); the model "
                  f"trains {len(params)}, numbered 0..{len(params) - 1}")
    for g in groups:
        betas = g.get("betas")
        ok = (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(_number(b) and 0 <= b < 1 for b in betas)
              and all(_finite(g.get(k)) and g[k] >= 0 for k in ("eps", "lr", "weight_decay"))
              and all(g.get(k) is None or isinstance(g[k], bool) for k in _FLAGS))
        if not ok:
            shown = {k: g.get(k) for k in ("betas", "eps", "lr", "weight_decay", *_FLAGS) if k in g}
            raise bad(f"an optimizer param_group has {str(shown)[:160]}; allowed: betas two numbers in [0, 1), "
                      f"eps, lr, weight_decay finite numbers >= 0, {', '.join(_FLAGS)} True, False or None")
    for i, s in per_param.items():
        if not (_count(i) and i < len(params)) or not isinstance(s, dict):
            raise bad(f"optimizer state entry {str(i)[:20]!r} is not a parameter's")
        for k, v in s.items():
            if k == "step":
                ok = (isinstance(v, torch.Tensor) and v.numel() == 1) or (_finite(v) and v >= 0)
            else:
                ok = isinstance(v, torch.Tensor) and v.is_floating_point() and tuple(v.shape) == tuple(params[i].shape)
            if not ok:
                shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise bad(f"optimizer state {k!r} of parameter {i} is {shape}; its parameter is "
                          f"{tuple(params[i].shape)}")


def _check_rng(rng: dict[str, Any], bad: Any) -> None:
    # Each saved RNG state is set on a scratch generator of its kind: what they refuse is malformed.
    try:
        t = rng["torch"]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"the torch state is a {type(t).__name__}")
        torch.Generator().set_state(t)
        v = rng["python"]
        random.Random().setstate((v[0], tuple(v[1]), v[2]))
        if "numpy" in rng:
            import numpy as np

            s = rng["numpy"]
            np.random.RandomState().set_state((s[0], np.array(s[1], dtype=np.uint32), s[2], s[3], s[4]))
        if "cuda" in rng and not all(isinstance(c, torch.Tensor) and c.dtype == torch.uint8 for c in rng["cuda"]):
            raise TypeError("the CUDA states must be uint8 tensors")
    except (KeyError, TypeError, ValueError, IndexError, OverflowError, RuntimeError) as exc:
        raise bad(f"the RNG states ({type(exc).__name__}: {str(exc)[:160]})") from None
