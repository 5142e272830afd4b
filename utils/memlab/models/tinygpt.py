"""TinyGPT: a small GPT-2 style decoder written from scratch in plain PyTorch.

Pre-LayerNorm blocks, learned positional embeddings, tanh-GELU MLP, tied embeddings (GPT-2,
Radford et al. 2019; nanoGPT's layout). The "manual" attention is the textbook one, so the
tensors autograd saves for backward are the ones the per-layer activation formula of
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
section 4.1) counts; ``memlab.accounting.activation_bytes_per_layer`` states that count. The
"sdpa" variant swaps in ``F.scaled_dot_product_attention`` for comparison.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from memlab.core.validation import check_bool, check_choice, check_positive_int, invalid

__all__ = ["ATTENTION_IMPLEMENTATIONS", "TinyGPTConfig", "CausalSelfAttention", "MLP", "Block", "TinyGPT"]

ATTENTION_IMPLEMENTATIONS = ("manual", "sdpa")

CheckpointFn = Callable[..., torch.Tensor]


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
        # check every field: a ValueError naming the field, its value and what is allowed
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            check_positive_int(f"TinyGPTConfig.{name}", getattr(self, name))
        if self.n_embd % self.n_head != 0:
            raise invalid("TinyGPTConfig.n_embd", self.n_embd,
                          f"a multiple of n_head={self.n_head} (head size = n_embd // n_head)")
        d = self.dropout
        # 1.0 would zero every activation; check_number has no strict maximum, so the range is spelled here
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 <= d < 1.0:
            raise invalid("TinyGPTConfig.dropout", d, "a float with 0 <= dropout < 1")
        check_choice("TinyGPTConfig.attention", self.attention, ATTENTION_IMPLEMENTATIONS)
        for name in ("bias", "tie_weights"):
            check_bool(f"TinyGPTConfig.{name}", getattr(self, name))


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
        # x: (B, T, n_embd), T <= block_size; each position attends to itself and those before it
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
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)).

    In training mode it saves for backward what ``memlab.accounting.activation_bytes_per_layer``
    counts (Korthikanti et al.'s per-layer formula, with the dropout-mask size as a parameter).
    """

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
    function (PyTorch's non-reentrant ``checkpoint`` by default, or your own). ``config`` None is
    ``TinyGPTConfig()`` (0.8M parameters).
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
        while training with gradients enabled. The model is changed in place.
        """
        if checkpoint_fn is None:
            checkpoint_fn = functools.partial(checkpoint, use_reentrant=False)
        self.checkpoint_fn = checkpoint_fn

    def gradient_checkpointing_disable(self) -> None:
        """Go back to keeping every block's activations for backward (in place)."""
        self.checkpoint_fn = None

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logits, loss)`` for token ids ``idx`` ``(B, T)``: logits ``(B, T, vocab_size)``; the
        mean cross entropy over all ``B*T`` positions against ``targets`` (the token after each of
        ``idx``'s, ``(B, T)``), or None without targets.

        Raises:
            ValueError: when ``T`` exceeds ``block_size`` (no learned position for it).
        """
        B, T = idx.shape
        if T > self.config.block_size:
            raise invalid("TinyGPT.forward: sequence length T", T, f"T <= block_size={self.config.block_size}")
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
