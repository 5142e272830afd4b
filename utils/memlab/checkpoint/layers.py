"""Checkpointing a whole model: wrap (and unwrap) each decoder layer's forward, as transformers'
``gradient_checkpointing_enable`` does, with the KV-cache and ``use_cache`` pitfalls handled."""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from memlab.checkpoint.recompute import checkpoint, tensor_leaves
from memlab.core.validation import check_positive_int

__all__ = ["enable", "disable"]

_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache")
_ENABLED = "_memlab_checkpoint_forward"  # the instance attribute enable() sets on each wrapped layer


def _cache_length(cache: Any) -> int:
    # tokens a KV cache holds (0 for an empty one; a tuple-style cache counts its elements)
    get = getattr(cache, "get_seq_length", None)
    if callable(get):
        try:
            return int(get())
        except Exception:  # noqa: BLE001 -- an exotic cache: assume it holds something
            return 1
    if isinstance(cache, (tuple, list)):
        return sum(t.numel() for t in tensor_leaves(cache))
    return 1


def _checkpointed_forward(layer: nn.Module, index: int, preserve_rng_state: bool, warned: list[bool]):
    forward = type(layer).forward.__get__(layer)  # transformers' own wrapper passes through when its flag is off

    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # generation, evaluation: nothing to save, the cache works as usual
            return forward(*args, **kwargs)
        for name in _CACHE_KWARGS:
            cache = kwargs.get(name)
            if cache is None:
                continue
            if _cache_length(cache) > 0:
                raise ValueError(
                    f"memlab.checkpoint.enable: decoder layer {index} got {name}= a KV cache that already holds "
                    f"tokens; a checkpointed layer is run twice (forward, then again in backward) and would "
                    f"write it twice; allowed with gradients on: use_cache=False and no past_key_values"
                )
            kwargs[name] = None  # an empty cache would keep every layer's keys and values alive until the step ends
            if not warned[0]:
                warned[0] = True
                warnings.warn(
                    "memlab.checkpoint.enable: the model was called with use_cache=True while training; the KV "
                    "cache would keep every layer's keys and values alive (activations checkpointing cannot "
                    "free) and be written twice, so the checkpointed layers ignore it; call the model with "
                    "use_cache=False (or leave model.config.use_cache=False, as enable() set it)",
                    UserWarning, stacklevel=4)
        return checkpoint(forward, *args, preserve_rng_state=preserve_rng_state, **kwargs)

    return run


def enable(model: nn.Module, *, every: int = 1, preserve_rng_state: bool = True) -> list[int]:
    """Checkpoint ``model``'s decoder layers with memlab's :func:`checkpoint`, in place: the one call
    that puts this chapter's checkpointing on a transformers model (or a peft-wrapped one, or
    TinyGPT) in your own project.

    The layers are :func:`memlab.models.decoder_layers` (``model.model.layers`` for Llama, Mistral,
    Qwen; ``transformer.h`` for GPT-2; ...). Layers ``0, every, 2*every, ...`` get a ``forward`` that
    runs the layer's own forward under :func:`checkpoint` whenever gradients are on (under
    ``torch.no_grad()``, e.g. in ``generate``, the layer runs as before). With ``every=1`` each
    layer keeps only its input; with ``every=k`` one layer in k is checkpointed.

    What would keep activations alive anyway is handled:

    * ``model.config.use_cache`` is set to ``False``: in training, a KV cache holds every layer's
      keys and values until the step ends. A call with ``use_cache=True`` while gradients are on
      warns once and the checkpointed layers drop the (empty) cache; a cache that already holds
      tokens is an error (the layer runs twice and would write it twice).
    * transformers' own gradient checkpointing, when on, is turned off with a warning (each layer
      would otherwise be recomputed twice in backward).
    * ``config.output_attentions=True`` warns: the attention probabilities of every layer
      (batch x heads x seq x seq) are returned, so they stay alive.

    Calling it again replaces the previous wrapping (``every`` may change); :func:`disable` undoes
    it.

    Args:
        every: checkpoint one decoder layer in ``every`` (1: all of them).
        preserve_rng_state: replay the forward's RNG state in the recomputation (dropout).

    Returns:
        The indices of the checkpointed layers.

    Raises:
        ValueError: a bad ``every``, or a KV cache that already holds tokens.
        TypeError: ``model`` is not a module, or ``preserve_rng_state`` not a bool.
    """
    from memlab.models import decoder_layers

    check_positive_int("every", every)  # 1 checkpoints every decoder layer
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"preserve_rng_state={preserve_rng_state!r} is invalid; allowed: True or False")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module (a transformers model, a peft model or TinyGPT), "
                        f"got {type(model).__name__}")
    layers = decoder_layers(model)
    # transformers >= 5.2x names it activation checkpointing; the gradient_* names are deprecated aliases
    hf_on = getattr(model, "is_activation_checkpointing", None)
    if hf_on is None:
        hf_on = getattr(model, "is_gradient_checkpointing", False)
    if hf_on is True or any(getattr(layer, "gradient_checkpointing", False) is True for layer in layers):
        disable_hf = getattr(model, "activation_checkpointing_disable", None) or getattr(
            model, "gradient_checkpointing_disable", None)
        if callable(disable_hf):
            disable_hf()
        for layer in layers:
            if getattr(layer, "gradient_checkpointing", False) is True:
                layer.gradient_checkpointing = False
        warnings.warn("memlab.checkpoint.enable: transformers' gradient checkpointing was on; turned it off "
                      "(each layer would have been recomputed twice in backward)", UserWarning, stacklevel=2)
    config = getattr(model, "config", None)
    if config is not None:
        if getattr(config, "use_cache", False):
            config.use_cache = False
        if getattr(config, "output_attentions", False):
            warnings.warn("memlab.checkpoint.enable: config.output_attentions=True returns every layer's "
                          "attention probabilities (batch x heads x seq x seq), which stay alive until the step "
                          "ends; set it to False while training", UserWarning, stacklevel=2)
    disable(model)
    warned = [False]
    chosen = []
    for i, layer in enumerate(layers):
        if i % every == 0:
            layer.forward = _checkpointed_forward(layer, i, preserve_rng_state, warned)
            setattr(layer, _ENABLED, True)
            chosen.append(i)
    return chosen


def disable(model: nn.Module) -> int:
    """Undo :func:`enable`: the decoder layers run their own forward again
    (``model.config.use_cache`` stays as :func:`enable` left it). Returns how many layers were unwrapped."""
    from memlab.models import decoder_layers

    n = 0
    for layer in decoder_layers(model):
        if layer.__dict__.pop(_ENABLED, False):
            layer.__dict__.pop("forward", None)
            n += 1
    return n

