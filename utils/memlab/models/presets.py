"""Published model architectures (GPT-2, Llama 2/3, Mistral, Qwen2.5) by name, and their sizes.

:data:`PRESETS` holds the dimensions from each model's config.json on the Hugging Face hub; the
functions build a ``transformers`` config or a randomly initialised model from them (on the
``meta`` device for the big ones) or count the parameters analytically, without building.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch.nn as nn

from memlab.core.validation import invalid
from memlab.core.optional import needs

__all__ = ["PRESETS", "UnknownPresetError", "CONFIG_LIMITS", "validate_config", "preset_config", "build_preset",
           "preset_parameter_count"]

# Dimensions copied from each model's config.json on the Hugging Face hub (repo = hf_id).
# Only the fields that shape the parameters are listed; RoPE settings and the like are
# left at the transformers defaults because they change no tensor size.
PRESETS: dict[str, dict[str, Any]] = {
    # Source: https://huggingface.co/openai-community/gpt2/blob/main/config.json
    "gpt2": dict(
        family="gpt2",
        hf_id="openai-community/gpt2",
        n_embd=768,
        n_layer=12,
        n_head=12,
        n_positions=1024,
        vocab_size=50257,
        tie_word_embeddings=True,
    ),
    # Source: https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json
    "llama-2-7b": dict(
        family="llama",
        hf_id="meta-llama/Llama-2-7b-hf",
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    ),
    # Source: https://huggingface.co/meta-llama/Llama-2-13b-hf/blob/main/config.json
    "llama-2-13b": dict(
        family="llama",
        hf_id="meta-llama/Llama-2-13b-hf",
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=40,
        vocab_size=32000,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    ),
    # Source: https://huggingface.co/meta-llama/Llama-2-70b-hf/blob/main/config.json
    "llama-2-70b": dict(
        family="llama",
        hf_id="meta-llama/Llama-2-70b-hf",
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    ),
    # Source: https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json
    "llama-3-8b": dict(
        family="llama",
        hf_id="meta-llama/Meta-Llama-3-8B",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    ),
    # Source: https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json
    "mistral-7b": dict(
        family="mistral",
        hf_id="mistralai/Mistral-7B-v0.1",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        sliding_window=4096,
    ),
    # Source: https://huggingface.co/Qwen/Qwen2.5-0.5B/blob/main/config.json
    # (Qwen2 has biases on the q/k/v projections; transformers' Qwen2 always adds them.)
    "qwen2.5-0.5b": dict(
        family="qwen2",
        hf_id="Qwen/Qwen2.5-0.5B",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    ),
    # Source: https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json
    "qwen2.5-7b": dict(
        family="qwen2",
        hf_id="Qwen/Qwen2.5-7B",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    ),
}

_PRESET_METADATA = ("family", "hf_id")


class UnknownPresetError(KeyError, ValueError):
    """Raised for a preset name that is not in :data:`PRESETS` (is a KeyError and a ValueError)."""

    def __str__(self) -> str:  # KeyError would otherwise show the message in quotes
        return str(self.args[0]) if self.args else ""


def _preset_fields(name: str, overrides: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    # (family, config kwargs) of a preset with overrides applied
    if name not in PRESETS:
        raise UnknownPresetError(str(invalid("name", name, "a preset: " + ", ".join(sorted(PRESETS)))))
    entry = PRESETS[name]
    fields = {k: v for k, v in entry.items() if k not in _PRESET_METADATA}
    fields.update(overrides)
    return entry["family"], fields


# the transformers class of each family, by name: only the family asked for is imported (each modeling module a
# family brings costs an import; a Llama estimate needs no GPT-2, Mistral or Qwen2 code)
_CONFIG_CLASS = {"gpt2": "GPT2Config", "llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config"}
_MODEL_CLASS = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM"}


def _config_class(family: str):
    with needs("memlab.models.preset_config"):
        import transformers

    return getattr(transformers, _CONFIG_CLASS[family])


def _model_class(family: str):
    with needs("memlab.models.build_preset"):
        import transformers

    return getattr(transformers, _MODEL_CLASS[family])


# Bounds on a config's dimensions: past them no real model exists, and a trace would run for
# minutes or overflow int64 element counts (the largest published models stay far inside them).
# They are counts of elements, not bytes, hence powers of two rather than memlab.core.units.
CONFIG_LIMITS: dict[str, tuple[tuple[str, ...], int, int]] = {
    "hidden": (("hidden_size", "n_embd", "d_model"), 1, 2**17),
    "layers": (("num_hidden_layers", "n_layer", "num_layers"), 1, 1024),
    "heads": (("num_attention_heads", "n_head"), 1, 1024),
    "kv_heads": (("num_key_value_heads",), 1, 1024),
    "vocab": (("vocab_size",), 1, 2**22),
    "intermediate": (("intermediate_size", "n_inner"), 1, 2**20),
    "positions": (("max_position_embeddings", "n_positions"), 1, 2**22),
    "head_dim": (("head_dim",), 1, 2**14),
}


def validate_config(config: Any, where: str = "config") -> None:
    """Refuse a model config whose dimensions cannot build a model, in one line naming the field.

    ``config``: a mapping (a config.json's fields, a preset's fields with overrides) or a
    ``transformers`` config. Each size present must be an int (not a bool, a float or a string)
    within :data:`CONFIG_LIMITS`; the hidden size must divide by the heads (unless ``head_dim``
    is given) and the heads by the key/value heads. ``None`` (an optional field left unset)
    passes. ``where`` says what the config is, prefixed to the error (``"preset 'gpt2'"``, a file
    name).

    Raises:
        ValueError: ``"<where>: num_attention_heads=0 is invalid; allowed: ..."``.
    """
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    found: dict[str, tuple[str, int]] = {}
    for what, (fields, lo, hi) in CONFIG_LIMITS.items():
        for f in fields:
            v = get(f, None)
            if v is None or (f == "n_inner" and v is None):
                continue
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"{where}: {f}={v!r} is invalid; allowed: an int from {lo} to {hi:,}")
            found.setdefault(what, (f, v))
            break
    if "hidden" in found and "heads" in found and "head_dim" not in found:
        (hf, h), (af, a) = found["hidden"], found["heads"]
        if h % a:
            raise ValueError(f"{where}: {hf}={h} is not divisible by {af}={a}; allowed: a {hf} that is a "
                             f"multiple of {af} (or an explicit head_dim)")
    if "heads" in found and "kv_heads" in found:
        (af, a), (kf, k) = found["heads"], found["kv_heads"]
        if a % k:
            raise ValueError(f"{where}: {kf}={k} does not divide {af}={a}; allowed: a divisor of {a}")


def preset_config(name: str, **overrides: Any):
    """The ``transformers`` config (GPT2Config, LlamaConfig, MistralConfig or Qwen2Config) of
    preset ``name``, with keyword ``overrides`` (config fields, e.g. ``num_hidden_layers=2``) applied.

    Raises:
        UnknownPresetError: for a name not in :data:`PRESETS`.
        ValueError: naming the field, for a size out of :func:`validate_config`'s bounds.
    """
    family, fields = _preset_fields(name, overrides)
    validate_config(fields, f"preset {name!r}")
    return _config_class(family)(**fields)


def build_preset(name: str, **overrides: Any) -> nn.Module:
    """A randomly initialised ``transformers`` causal LM with preset ``name``'s architecture.

    No weights are downloaded. The big presets need tens of GB in fp32: build them under
    ``with torch.device("meta"):`` (free) unless you really mean it. ``overrides`` as in
    :func:`preset_config`.

    Raises:
        UnknownPresetError: for a name not in :data:`PRESETS`.
    """
    family, _ = _preset_fields(name, overrides)
    return _model_class(family)(preset_config(name, **overrides))


def preset_parameter_count(name: str, **overrides: Any) -> int:
    """Exact number of (unique) parameters of preset ``name``, computed from its dimensions.

    Nothing is built; tied embeddings are counted once. Overrides are applied first, as in
    :func:`preset_config`.

    Raises:
        UnknownPresetError: for a name not in :data:`PRESETS`.
    """
    family, d = _preset_fields(name, overrides)
    if family == "gpt2":
        E, L, V, P = d["n_embd"], d["n_layer"], d["vocab_size"], d["n_positions"]
        inner = d.get("n_inner") or 4 * E
        per_layer = (
            2 * E  # ln_1 weight + bias
            + E * 3 * E + 3 * E  # attn.c_attn (fused q, k, v)
            + E * E + E  # attn.c_proj
            + 2 * E  # ln_2
            + E * inner + inner  # mlp.c_fc
            + inner * E + E  # mlp.c_proj
        )
        total = V * E + P * E + L * per_layer + 2 * E  # wte + wpe + blocks + ln_f
        if not d.get("tie_word_embeddings", True):
            total += V * E  # lm_head (no bias)
        return total

    H, I, L, V = d["hidden_size"], d["intermediate_size"], d["num_hidden_layers"], d["vocab_size"]
    nh = d["num_attention_heads"]
    nkv = d.get("num_key_value_heads") or nh
    hd = d.get("head_dim") or H // nh
    q_out, kv_out = nh * hd, nkv * hd
    attn = H * q_out + 2 * H * kv_out + q_out * H  # q, k, v, o projections
    if family == "qwen2":
        attn += q_out + 2 * kv_out  # q/k/v biases (o_proj has none)
    elif d.get("attention_bias", False):
        attn += q_out + 2 * kv_out + H  # Llama's attention_bias adds all four biases
    mlp = 3 * H * I  # gate, up, down (SwiGLU)
    if d.get("mlp_bias", False):
        mlp += 2 * I + H
    per_layer = attn + mlp + 2 * H  # + input / post-attention RMSNorm weights
    total = V * H + L * per_layer + H  # embed_tokens + layers + final norm
    if not d.get("tie_word_embeddings", False):
        total += V * H  # lm_head
    return total
