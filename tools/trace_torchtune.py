"""The torchtune rows of `memlab estimate --validate`, traced with torchtune's own Llama instead of transformers'.

torchtune's README table "Optimization flags" (validate.py's torchtune rows) was measured on torchtune's own
TransformerDecoder; the validation traces transformers' Llama of the same dimensions, since torchtune is no
dependency of memlab. This script traces torchtune's model through the estimator's callable route (a model factory
of the depth, traced at 3, 4 and 5 layers and extrapolated) with the recipe's step, on fake tensors, for a CUDA
target, and prints each row's allocated estimate against the published figure.

    pip install --no-deps torchtune==0.4.0 torchao==0.13.0 && pip install omegaconf sentencepiece tiktoken blobfile
    PYTHONPATH=utils python tools/trace_torchtune.py            # every row; some ten seconds on 2 cores

torchtune 0.4.0 is the release of the run's month (November 2024); later releases changed the model (0.6.1's
RMSNorm calls F.rms_norm on an fp32 input with a bf16 weight, which PyTorch runs unfused), so the script names
the version it traced. One change to torchtune for the trace: Llama 3's RoPE scaling picks each frequency's
factor in a Python loop over tensor values, which a fake tensor cannot give; the frequencies are kept unscaled
(the same shapes and bytes, other values).

Stored output: results/cpu/torchtune_own_model.txt.
"""
from __future__ import annotations

import sys
import time

# (row, published 'Peak Memory Active' GiB, the row's settings): validate.py's torchtune rows, in the table's order
ROWS = (("+ Packed Dataset", 60.0, dict(chunks=0, ac=False, oib=False)),
        ("+ Chunked Cross Entropy", 42.9, dict(chunks=8, ac=False, oib=False)),
        ("+ Activation Checkpointing", 24.9, dict(chunks=8, ac=True, oib=False)),
        ("+ Fuse optimizer step into backward", 23.1, dict(chunks=8, ac=True, oib=True)))
GIB = 2 ** 30


def _torchtune():
    try:
        import torchtune
        from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE
    except ImportError as exc:
        print(f"trace_torchtune: torchtune does not import ({exc}); install it as this file's docstring shows",
              file=sys.stderr)
        raise SystemExit(2) from None
    Llama3ScaledRoPE.apply_scaling = lambda self, freqs, *a: freqs.clone()  # see the docstring
    return torchtune.__version__


def _factory(chunks: int, ac: bool):
    from torchtune.models.llama3_2 import llama3_2
    from torchtune.modules import TransformerSelfAttentionLayer

    def build(depth: int = 28):  # Llama 3.2 3B as torchtune's llama3_2_3b builds it, at any depth
        model = llama3_2(vocab_size=128_256, num_layers=depth, num_heads=24, num_kv_heads=8, embed_dim=3072,
                         max_seq_len=131_072, intermediate_dim=8192, attn_dropout=0.0, norm_eps=1e-5,
                         rope_base=500_000, scale_factor=32)
        if chunks:  # the recipe does this for CEWithChunkedOutputLoss: the head returns a list of chunks
            model.set_num_output_chunks(chunks)
        if ac:  # the recipe's enable_activation_checkpointing: every decoder layer wrapped
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                apply_activation_checkpointing, checkpoint_wrapper)

            apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                           check_fn=lambda m: isinstance(m, TransformerSelfAttentionLayer))
        return model
    return build


def _step(chunks: int):
    import torch.nn.functional as F

    if chunks:
        from torchtune.modules.loss import CEWithChunkedOutputLoss

        loss_fn = CEWithChunkedOutputLoss(num_output_chunks=chunks)

        def chunked(model, batch):
            return loss_fn(model(batch["input_ids"]), batch["labels"])
        return chunked

    def plain(model, batch):  # the recipe's loss on the logits the model upcast to fp32
        logits = model(batch["input_ids"])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch["labels"].reshape(-1))
    return plain


def estimate_row(chunks: int, ac: bool, oib: bool):
    """The estimate of one row's step (ROWS' settings) on torchtune's own Llama (call :func:`_torchtune` first)."""
    from memlab.estimate import estimate_training_memory

    return estimate_training_memory(_factory(chunks, ac), batch_size=2, seq_len=4096, dtype="bf16-pure",
                                    optimizer="adamw", optimizer_impl="for-loop", step=_step(chunks), device="cuda",
                                    gpu="a100-80gb", optimizer_in_backward=oib)


def main() -> int:
    version = _torchtune()
    print(f"torchtune {version}'s own Llama 3.2 3B traced (memlab's callable route), batch 2 x 4096, bf16-pure, "
          f"for-loop AdamW, CUDA target a100-80gb")
    print(f"{'row':<40} {'published':>10} {'estimate':>10} {'error':>7}  peak in")
    for name, gib, kw in ROWS:
        t0 = time.perf_counter()
        est = estimate_row(**kw)
        allocated = est.allocated_bytes
        print(f"{name:<40} {gib:>6.2f} GiB {allocated / GIB:>6.2f} GiB {100 * (allocated / (gib * GIB) - 1):>+6.1f}%"
              f"  {est.peak_phase} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print("compile=True from the second row on in the published run: the traces here are eager")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
