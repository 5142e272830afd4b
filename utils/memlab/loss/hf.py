"""One line to train a transformers ``*ForCausalLM`` with the fused loss: its logits are never materialised.

:func:`enable` replaces the model's ``forward`` (on the instance) by one that, in training with
``labels``, runs the decoder, then the fused linear cross-entropy on its last hidden states and
the head's weight (the tied embedding when the head is tied), and returns the loss with
``logits=None``. Without labels, or in eval mode, the model's own forward runs unchanged.
:func:`disable` puts the model's own forward back.

The loss is the model's own (``transformers.loss.loss_utils.ForCausalLMLoss``): labels shifted left
by one and padded with ``ignore_index`` (or the ``shift_labels`` given), the mean over the counted
tokens, or the sum over ``num_items_in_batch`` when the trainer passes it; Gemma 2's and 3's
``final_logit_softcapping`` is applied inside the fused loss. The same idea as Liger-Kernel's
patched forwards (``liger_kernel.transformers``), written once for every model whose head is
``logits = lm_head(hidden)`` (plus the soft-cap): the model types in :data:`SUPPORTED`.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from typing import Any

import torch

from memlab.core.validation import check_choice, check_positive_int, invalid
from memlab.loss.fused import FusedLinearCrossEntropy
from memlab.loss.reference import check_loss_args
from memlab.loss.triton_fused import TritonFusedLinearCrossEntropy

__all__ = ["enable", "disable", "is_enabled", "causal_lm_head", "SUPPORTED", "IMPLS"]

#: model types whose causal-LM head is ``lm_head(hidden)``, soft-capped by ``final_logit_softcapping`` if
#: the config has one (checked in transformers 5.24's modeling files; Granite's and Cohere's scale their
#: logits, MoE models add a router loss: not these)
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "smollm3")
#: ``impl`` -> the autograd Function that computes the loss
IMPLS = {"torch": FusedLinearCrossEntropy, "triton": TritonFusedLinearCrossEntropy}
_MARK = "_memlab_fused_loss"


def causal_lm_head(model: Any) -> torch.nn.Module:
    """The head of ``model``, after checking that it is a supported ``*ForCausalLM`` with a plain linear head.

    Raises:
        ValueError: ``model`` is not one (the argument, its value and what is allowed named).
    """
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "get_output_embeddings") \
            or not hasattr(model, "get_decoder") or not hasattr(model, "config"):
        raise invalid("model", type(model).__name__, "a transformers *ForCausalLM (a PreTrainedModel with a head)")
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED:
        raise invalid("model.config.model_type", model_type, ", ".join(SUPPORTED))
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise invalid("model's output embeddings", type(head).__name__,
                      "a torch.nn.Linear head (a quantized or adapter-wrapped head computes its logits differently)")
    return head


def enable(model: Any, *, chunk_size: int = 1024, impl: str = "torch") -> Any:
    """Make ``model`` compute its training loss with the fused linear cross-entropy; returns ``model``.

    In training mode with ``labels``, ``model(...)`` returns the same loss as the model's own (and
    the same gradients, up to the order of the sums) with ``logits=None``: no ``tokens x vocabulary``
    tensor is made or kept. In eval mode, or without labels, the model's own forward runs. Calling
    it again replaces the settings.

    Args:
        chunk_size: tokens per chunk of the fused loss (one ``chunk_size x V`` fp32 tile is its peak).
        impl: ``"torch"`` (:class:`~memlab.loss.FusedLinearCrossEntropy`) or ``"triton"`` (the Triton
            kernels; on CPU tensors, Triton's interpreter).

    Raises:
        ValueError: not a supported ``*ForCausalLM`` (see :data:`SUPPORTED`), a head that is not a
            plain ``nn.Linear``, a bad ``chunk_size`` or ``impl``.
    """
    check_positive_int("chunk_size", chunk_size)
    check_choice("impl", impl, IMPLS)
    causal_lm_head(model)
    disable(model)
    own = type(model).forward

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _fused_forward(self, args, kwargs)

    functools.update_wrapper(forward, own)  # the model's signature (transformers' Trainer reads it)
    setattr(forward, _MARK, True)
    # the settings live on the model and the method is bound to it, so a deep copy of the model is enabled
    # for itself (a closure over the model would keep calling the original)
    setattr(model, _MARK, dict(chunk_size=chunk_size, impl=impl, previous=model.__dict__.get("forward")))
    model.forward = types.MethodType(forward, model)
    return model


def _ours(model: Any) -> bool:
    mine = model.__dict__.get("forward") if isinstance(model, torch.nn.Module) else None
    return getattr(mine, _MARK, False) is True and isinstance(getattr(model, _MARK, None), dict)


def disable(model: Any) -> Any:
    """Give ``model`` its own forward back (a model :func:`enable` never touched is returned as it is)."""
    if _ours(model):
        previous = model.__dict__.pop(_MARK)["previous"]
        if previous is None:
            del model.forward
        else:
            model.forward = previous
    return model


def is_enabled(model: Any) -> dict[str, Any] | None:
    """The settings :func:`enable` gave ``model`` (``chunk_size``, ``impl``), or None."""
    if not _ours(model):
        return None
    return {k: v for k, v in getattr(model, _MARK).items() if k != "previous"}


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """transformers' shift: position ``i`` predicts token ``i + 1``; the last position gets ``ignore_index``."""
    return torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _fused_forward(model: Any, args: tuple, kwargs: dict) -> Any:
    # the model's forward with the fused loss, or its own forward where that is not training with labels
    settings = getattr(model, _MARK)
    own = settings["previous"] or types.MethodType(type(model).forward, model)
    sig = inspect.signature(own)
    bound = sig.bind(*args, **kwargs)
    arguments = dict(bound.arguments)
    var_kw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    extra = dict(arguments.pop(var_kw, {})) if var_kw else {}
    labels = arguments.pop("labels", None)
    keep = arguments.pop("logits_to_keep", 0)
    if not model.training or labels is None or not (isinstance(keep, int) and keep == 0):
        return own(*args, **kwargs)
    return_dict = extra.pop("return_dict", None)
    outputs = model.get_decoder()(**arguments, **extra, return_dict=True)
    hidden = outputs.last_hidden_state
    head = causal_lm_head(model)
    ignore_index = extra.get("ignore_index", -100)
    targets = extra.get("shift_labels")
    if targets is None:
        targets = shift_labels(labels, ignore_index)
    h, t = check_loss_args("memlab.loss.enable", hidden, head.weight, targets.to(hidden.device), head.bias,
                           chunk_size=settings["chunk_size"], ignore_index=ignore_index)
    softcap = getattr(model.config, "final_logit_softcapping", None)
    loss = IMPLS[settings["impl"]].apply(h, head.weight, t, head.bias, ignore_index, settings["chunk_size"],
                                         None if softcap is None else float(softcap), 0.0,
                                         extra.get("num_items_in_batch"))
    from transformers.modeling_outputs import CausalLMOutputWithPast

    names = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} - {"loss", "logits"}
    out = CausalLMOutputWithPast(loss=loss, logits=None, **{k: v for k, v in outputs.items() if k in names})
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    return out if return_dict else out.to_tuple()
