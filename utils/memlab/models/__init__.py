"""The models the course trains and measures.

* :mod:`memlab.models.tinygpt` -- :class:`TinyGPT`, a small GPT-2 style decoder in plain PyTorch
  whose saved activations are the ones Korthikanti et al. 2022 count.
* :mod:`memlab.models.llama` -- :func:`tiny_llama`, a small ``transformers`` Llama built from a
  config (never downloaded).
* :mod:`memlab.models.presets` -- :data:`PRESETS`, the published dimensions of GPT-2, Llama 2/3,
  Mistral and Qwen2.5, to build on the ``meta`` device or count analytically.
* :mod:`memlab.models.common` -- helpers for any of them: :func:`count_parameters`,
  :func:`decoder_layers`, :func:`lm_loss`.
* :mod:`memlab.models.corpus` -- the byte-level corpus they train on (the standard library's
  own source, no download) and its tokenizer.

``transformers`` is imported lazily, so ``TinyGPT`` works with PyTorch alone; each name is imported from its
module when first used, so the presets' table is read without torch.
"""

from __future__ import annotations

from memlab.core.optional import lazy_attributes

# Each public name from its module, imported when first asked for: the presets' table (memlab.models.presets) is
# read without importing torch or transformers (memlab estimate resolves a preset before either).
_WHERE = {
    **{n: "memlab.models.common" for n in ("NoDecoderLayersError", "count_parameters", "decoder_layers", "lm_loss")},
    **{n: "memlab.models.llama" for n in ("TINY_LLAMA_DEFAULTS", "tiny_llama", "tiny_llama_config")},
    **{n: "memlab.models.presets" for n in ("CONFIG_LIMITS", "PRESETS", "UnknownPresetError", "build_preset",
                                            "preset_config", "preset_parameter_count", "validate_config")},
    **{n: "memlab.models.tinygpt" for n in ("ATTENTION_IMPLEMENTATIONS", "MLP", "Block", "CausalSelfAttention",
                                            "TinyGPT", "TinyGPTConfig")},
}


__getattr__, __dir__ = lazy_attributes(__name__, _WHERE, globals())


__all__ = [
    "validate_config",
    "CONFIG_LIMITS",
    "TinyGPTConfig",
    "TinyGPT",
    "Block",
    "CausalSelfAttention",
    "MLP",
    "tiny_llama_config",
    "tiny_llama",
    "PRESETS",
    "UnknownPresetError",
    "preset_config",
    "build_preset",
    "preset_parameter_count",
    "count_parameters",
    "decoder_layers",
    "NoDecoderLayersError",
    "lm_loss",
]
