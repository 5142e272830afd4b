"""Models used throughout LLM Memory Lab.

Three kinds of model live here:

* :class:`TinyGPT` -- a small GPT-2 style decoder written from scratch in plain PyTorch
  (pre-LayerNorm blocks, learned positional embeddings, tanh-GELU MLP, tied embeddings).
  Its "manual" attention is deliberately the textbook implementation, so the tensors that
  autograd saves for backward are exactly the ones counted by the per-layer activation
  formula of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models"): ``s*b*h*(34 + 5*a*s/h)`` bytes per layer in 16-bit precision.
  The "sdpa" variant swaps in ``F.scaled_dot_product_attention`` for comparison.

  Measured with ``torch.autograd.graph.saved_tensors_hooks`` (counting each storage once,
  leaving out parameters, buffers and LayerNorm's per-row mean/rstd), one training-mode
  :class:`Block` saves ``s*b*h*(16*e + 2*m) + a*s*s*b*(2*e + m)`` bytes, with ``e`` the
  activation element size and ``m`` the dropout-mask element size: on CUDA ``m = 1`` (bool
  masks), which for ``e = 2`` is exactly Korthikanti's ``34*s*b*h + 5*a*s*s*b``; on CPU
  PyTorch stores masks in the activation dtype (``m = e``). With ``dropout=0`` no masks are
  made and the softmax output doubles as the dropout output: ``s*b*h*16*e + a*s*s*b*e``.
* :func:`tiny_llama` -- an 0.8M-parameter ``transformers`` Llama built from a
  config (never downloaded), for chapters that exercise the Hugging Face stack.
* :data:`PRESETS` -- the published dimensions of well-known models (GPT-2, Llama 2/3,
  Mistral, Qwen2.5) with :func:`preset_config`, :func:`build_preset` and an analytic
  :func:`preset_parameter_count`, for back-of-the-envelope memory budgets of models far
  too large to build for real (build them on the ``meta`` device instead).

``transformers`` is imported lazily, so ``TinyGPT`` works with PyTorch alone.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from memlab.optional import needs

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

ATTENTION_IMPLEMENTATIONS = ("manual", "sdpa")

CheckpointFn = Callable[..., torch.Tensor]


# --------------------------------------------------------------------------------------
# TinyGPT
# --------------------------------------------------------------------------------------


@dataclass
class TinyGPTConfig:
    """Hyper-parameters of :class:`TinyGPT`.

    The defaults give a 0.8M-parameter byte-level model (vocab 256) that trains on a CPU.
    """

    vocab_size: int = 256  # byte-level: every byte value is a token
    block_size: int = 128  # maximum sequence length (number of learned positions)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True  # biases in Linear layers and LayerNorms, as in GPT-2
    mlp_ratio: int = 4  # MLP hidden width = mlp_ratio * n_embd
    attention: str = "manual"  # "manual" (textbook, Korthikanti-countable) or "sdpa"
    tie_weights: bool = True  # lm_head shares its weight with tok_emb

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"TinyGPTConfig: {name}={value!r} is invalid; allowed: a positive int"
                )
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"TinyGPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                f"allowed: n_embd a multiple of n_head (head size = n_embd // n_head)"
            )
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not (
            0.0 <= self.dropout < 1.0
        ):
            raise ValueError(
                f"TinyGPTConfig: dropout={self.dropout!r} is invalid; allowed: a float with "
                f"0 <= dropout < 1"
            )
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"TinyGPTConfig: attention={self.attention!r} is invalid; allowed: "
                f"{', '.join(repr(a) for a in ATTENTION_IMPLEMENTATIONS)}"
            )
        for name in ("bias", "tie_weights"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(
                    f"TinyGPTConfig: {name}={value!r} is invalid; allowed: True or False"
                )


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection (GPT-2 layout)."""

    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.attention = config.attention
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        # True above the diagonal = "this key is in the future of this query".
        # Built once here so the forward pass slices it instead of allocating a new mask.
        future_mask = torch.triu(
            torch.ones(config.block_size, config.block_size, dtype=torch.bool), diagonal=1
        )
        self.register_buffer("future_mask", future_mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hd = C // self.n_head
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, hd).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.n_head, hd).transpose(1, 2)
        v = v.view(B, T, self.n_head, hd).transpose(1, 2)

        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
            )
        else:
            # The textbook version: every intermediate below is a real tensor that
            # autograd may keep for backward (the (B, nh, T, T) ones dominate).
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
            att = att.masked_fill(self.future_mask[:T, :T], float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v  # (B, nh, T, hd)

        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network: Linear -> GELU(tanh) -> Linear -> Dropout."""

    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class TinyGPT(nn.Module):
    """A small GPT-2 style language model.

    ``forward(idx, targets=None)`` returns ``(logits, loss)`` where ``logits`` has shape
    ``(B, T, vocab_size)`` and ``loss`` is the mean cross entropy over all ``B*T``
    positions (``None`` without targets). ``targets[b, t]`` is the token that follows
    ``idx[b, t]``.

    Call :meth:`gradient_checkpointing_enable` to wrap every block in a checkpoint
    function (PyTorch's non-reentrant ``checkpoint`` by default, or your own).
    """

    def __init__(self, config: TinyGPTConfig | None = None) -> None:
        super().__init__()
        self.config = config if config is not None else TinyGPTConfig()
        cfg = self.config
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.tok_emb.weight
        self.checkpoint_fn: CheckpointFn | None = None

        self.apply(self._init_weights)
        # GPT-2: residual projections get std 0.02/sqrt(2*n_layer), because every layer
        # adds two of them (attention and MLP) to the residual stream.
        proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=proj_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def gradient_checkpointing_enable(self, checkpoint_fn: CheckpointFn | None = None) -> None:
        """Recompute each block in backward instead of keeping its activations.

        ``checkpoint_fn(block, x)`` must return ``block(x)``; the default is
        ``torch.utils.checkpoint.checkpoint`` with ``use_reentrant=False``. It is only used
        while training with gradients enabled.
        """
        if checkpoint_fn is None:
            checkpoint_fn = functools.partial(checkpoint, use_reentrant=False)
        self.checkpoint_fn = checkpoint_fn

    def gradient_checkpointing_disable(self) -> None:
        """Go back to keeping every block's activations for backward."""
        self.checkpoint_fn = None

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(
                f"TinyGPT.forward: sequence length T={T} exceeds block_size="
                f"{self.config.block_size}; allowed: T <= block_size"
            )
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        use_checkpoint = (
            self.checkpoint_fn is not None and torch.is_grad_enabled() and self.training
        )
        for block in self.blocks:
            if use_checkpoint:
                x = self.checkpoint_fn(block, x)
            else:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


# --------------------------------------------------------------------------------------
# A tiny Hugging Face Llama
# --------------------------------------------------------------------------------------

TINY_LLAMA_DEFAULTS: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    attn_implementation="eager",
)


def tiny_llama_config(**overrides: Any):
    """A small ``transformers.LlamaConfig`` (byte vocab, 4 layers, GQA with 2 KV heads).

    Keyword arguments override the defaults in :data:`TINY_LLAMA_DEFAULTS`.
    """
    with needs("memlab.models.tiny_llama_config"):
        from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_LLAMA_DEFAULTS, **overrides})


def tiny_llama(**overrides: Any):
    """A randomly initialised ``transformers.LlamaForCausalLM`` built from
    :func:`tiny_llama_config` (nothing is downloaded; seed torch yourself first)."""
    with needs("memlab.models.tiny_llama"):
        from transformers import LlamaForCausalLM

    return LlamaForCausalLM(tiny_llama_config(**overrides))


# --------------------------------------------------------------------------------------
# Published architectures
# --------------------------------------------------------------------------------------

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
    """(family, config kwargs) of a preset with ``overrides`` applied."""
    if name not in PRESETS:
        raise UnknownPresetError(
            f"unknown preset name={name!r}; allowed: {', '.join(sorted(PRESETS))}"
        )
    entry = PRESETS[name]
    fields = {k: v for k, v in entry.items() if k not in _PRESET_METADATA}
    fields.update(overrides)
    return entry["family"], fields


def _config_class(family: str):
    with needs("memlab.models.preset_config"):
        import transformers

    return {
        "gpt2": transformers.GPT2Config,
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
    }[family]


def _model_class(family: str):
    with needs("memlab.models.build_preset"):
        import transformers

    return {
        "gpt2": transformers.GPT2LMHeadModel,
        "llama": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
    }[family]


# Bounds on a config's dimensions: past them no real model exists, and a trace would run for
# minutes or overflow int64 element counts (the largest published models stay far inside them).
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
    passes. ValueError otherwise: ``"<where>: num_attention_heads=0 is invalid; allowed: ..."``.
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
    """The ``transformers`` config (GPT2Config / LlamaConfig / MistralConfig / Qwen2Config)
    of preset ``name``, with keyword ``overrides`` applied (e.g. ``num_hidden_layers=2``);
    ValueError naming the field for a size out of :func:`validate_config`'s bounds."""
    family, fields = _preset_fields(name, overrides)
    validate_config(fields, f"preset {name!r}")
    return _config_class(family)(**fields)


def build_preset(name: str, **overrides: Any) -> nn.Module:
    """A randomly initialised ``transformers`` causal LM with preset ``name``'s architecture.

    No weights are downloaded. The big presets need tens of GB in fp32: build them under
    ``with torch.device("meta"):`` (free) unless you really mean it.
    """
    family, _ = _preset_fields(name, overrides)
    return _model_class(family)(preset_config(name, **overrides))


def preset_parameter_count(name: str, **overrides: Any) -> int:
    """Exact number of (unique) parameters of preset ``name``, computed from its dimensions.

    Nothing is built. Overrides are applied first, as in :func:`preset_config`.
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


# --------------------------------------------------------------------------------------
# Helpers shared by all models
# --------------------------------------------------------------------------------------


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameter elements in ``model``, counting shared (tied) tensors once.

    Sharing is detected by identity (the same ``Parameter`` object) and, for tensors with
    real storage, by storage (different ``Parameter`` objects viewing the same memory).
    Works on the meta device and on fake tensors. ``trainable_only`` counts only ``requires_grad`` parameters.
    """
    seen_ids: set[int] = set()
    seen_storage: set[tuple] = set()
    total = 0
    for param in model.parameters(recurse=True):
        if id(param) in seen_ids:
            continue
        seen_ids.add(id(param))
        if trainable_only and not param.requires_grad:
            continue
        if param.device.type != "meta" and param.numel() > 0:
            if not _is_fake(param):  # fake tensors have no memory: identity only
                ptr = param.untyped_storage().data_ptr()
                key = (param.device.type, ptr, param.storage_offset(), tuple(param.shape), tuple(param.stride()), param.dtype)
                if key in seen_storage:
                    continue
                seen_storage.add(key)
        total += param.numel()
    return total


_LAYER_PATHS = ("blocks", "model.layers", "transformer.h", "base_model.model.model.layers", "gpt_neox.layers",
                "layers", "h")


class NoDecoderLayersError(ValueError):
    """Raised by :func:`decoder_layers` for a model without a stack of decoder layers."""


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's stack of transformer blocks: TinyGPT ``.blocks``, Llama/Mistral/Qwen ``.model.layers``,
    GPT-2 ``.transformer.h``, a peft-wrapped Llama, GPT-NeoX; else the longest ``nn.ModuleList`` in it.
    What checkpointing wraps (memlab.train) and FSDP2 shards unit by unit (memlab.distributed)."""
    for path in _LAYER_PATHS:
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, (nn.ModuleList, nn.Sequential)) and len(obj):
            return list(obj)
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if lists:
        return list(max(lists, key=len))
    raise NoDecoderLayersError(f"model={type(model).__name__} has no stack of decoder layers (looked at "
                     f"{', '.join(_LAYER_PATHS)} and for any nn.ModuleList); allowed: a transformers decoder "
                     f"(Llama, GPT-2, ...) or memlab.models.TinyGPT")


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of ``model`` on inputs ``x`` and targets ``y``.

    ``y[b, t]`` is the token after ``x[b, t]`` (the convention of :func:`memlab.data.batches`
    and :class:`TinyGPT`), for every position -- so no extra shifting is done for
    ``transformers`` models, which are called as ``model(input_ids=x)``.
    """
    if isinstance(model, TinyGPT):
        _, loss = model(x, y)
        return loss
    if hasattr(model, "config"):  # transformers model (or a wrapper such as a PEFT model)
        out = model(input_ids=x, use_cache=False)
    else:
        out = model(x)
    if hasattr(out, "logits"):
        logits = out.logits
    elif isinstance(out, (tuple, list)):
        logits = out[0]
    else:
        logits = out
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

