"""The litgpt rows of `memlab estimate --validate`, traced with litgpt's own GPT and LoRA instead of transformers'.

litgpt's config_hub table (validate.py's litgpt rows, A10G, March 2024) was measured on litgpt's own model; the
validation traces transformers' model of the same dimensions, since litgpt is no dependency of memlab. This script
traces litgpt's model through the estimator's callable route (a model factory of the depth, traced at a few depths
and extrapolated) with litgpt's training step, on fake tensors, for the A10G's chip (memlab's rtx3090: sm 8.6), and
prints each row's allocated estimate against the published figure twice: with the model's outputs as Lightning
Fabric's bf16-true plugin hands them back (cast to float32, validate.fabric_outputs) and without that cast (the
bf16 logits the model computes), which shows what the cast costs. Then the three QLoRA rows, which validate lists
as not expressible (litgpt quantizes the head too), as litgpt ran them: every linear NF4, bitsandbytes 0.42's
MatMul4Bit keeping its input (:data:`BNB_VERSION`), paged AdamW, Fabric's cast.

litgpt's package needs Lightning and a tokenizer to import; the three files the model needs (litgpt/model.py,
lora.py, config.py) are loaded from a litgpt source tree into a package of their own, with a stand-in for the
two functions of litgpt.utils they import:

    git clone https://github.com/Lightning-AI/litgpt && git -C litgpt checkout bc3c337f
    PYTHONPATH=utils python tools/trace_litgpt.py --src litgpt          # every row; some 30 s on 2 cores

bc3c337f is the commit of the table's first rows (0d207708, of the last three, has the same model, LoRA, loop and
loss files). Stored output: results/cpu/litgpt_own_model.txt.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
import types
from pathlib import Path

# config file, litgpt's model name, published GB (1e9 bytes), micro-batch, micro-batches a step, LoRA or None (full)
ROWS = (("gemma-2b/lora.yaml", "gemma-2b", 12.62, 2, 3, dict(r=16, alpha=16, dropout=0.1, every=True)),
        ("tiny-llama/lora.yaml", "tiny-llama-1.1b", 13.50, 8, 1, dict(r=32, alpha=16, dropout=0.05, every=True)),
        ("tiny-llama/full.yaml", "tiny-llama-1.1b", 14.10, 4, 8, None),
        ("llama-2-7b/lora.yaml", "Llama-2-7b-hf", 19.77, 2, 4, dict(r=32, alpha=16, dropout=0.05, every=False)),
        ("mistral-7b/lora.yaml", "Mistral-7B-v0.1", 20.65, 2, 4, dict(r=32, alpha=16, dropout=0.05, every=False)),
        ("phi-2/lora.yaml", "phi-2", 13.98, 4, 2, dict(r=8, alpha=16, dropout=0.05, every=True)))
# the three QLoRA rows (quantize: bnb.nf4): every nn.Linear, the head's too, in NF4 without double quantization
QLORA_ROWS = (("gemma-2b/qlora.yaml", "gemma-2b", 11.51, 2, 3, dict(r=16, alpha=16, dropout=0.1, every=True)),
              ("tiny-llama/qlora.yaml", "tiny-llama-1.1b", 16.24, 8, 1, dict(r=32, alpha=16, dropout=0.05, every=True)),
              ("llama-2-7b/qlora.yaml", "Llama-2-7b-hf", 13.68, 2, 4, dict(r=32, alpha=16, dropout=0.05, every=False)))
BNB_VERSION = "0.42.0"  # the table's (validate._LITGPT_GPU): MatMul4Bit keeps its input for backward
SEQ_LEN = 512  # the configs' max_seq_length (Alpaca2k batches are padded to their longest sample: at most this)


def load_litgpt(src: Path) -> types.ModuleType:
    """litgpt.lora (with litgpt.model and litgpt.config) from the source tree ``src``, under the name ``litgpt``:
    a package object without litgpt's own __init__ (which imports Lightning), litgpt.utils a stand-in."""
    files = [src / "litgpt" / f"{name}.py" for name in ("model", "config", "lora")]
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise SystemExit(f"trace_litgpt: --src {src} is not a litgpt source tree (missing {', '.join(missing)})")
    pkg = types.ModuleType("litgpt")
    pkg.__path__ = [str(src / "litgpt")]
    utils = types.ModuleType("litgpt.utils")  # the two functions model.py, config.py and lora.py import
    utils.find_multiple = lambda n, k: n if n % k == 0 else n + k - n % k
    utils.map_old_state_dict_weights = lambda state_dict, mapping, prefix: state_dict
    pkg.utils = utils
    sys.modules.update({"litgpt": pkg, "litgpt.utils": utils})
    importlib.import_module("litgpt.model")  # first, as litgpt's __init__ does: config.py imports it back
    return importlib.import_module("litgpt.lora")


def factory(lora_mod: types.ModuleType, name: str, lora: dict | None, nf4: bool = False):
    """A model factory of the depth: litgpt's GPT (LoRA's when ``lora``), its sequence length set as fit() sets it;
    ``nf4``: every nn.Linear (the LoRA layers' frozen linears and the head's included) replaced by memlab's NF4
    Linear4bit without double quantization, as Lightning's BitsandbytesPrecision("nf4") converts them."""
    full_depth = lora_mod.Config.from_name(name).n_layer

    def build(depth: int = full_depth):
        kw: dict = dict(n_layer=depth)
        if lora:
            every = lora["every"]
            kw.update(lora_r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"], lora_query=True,
                      lora_key=every, lora_value=True, lora_projection=every, lora_mlp=every, lora_head=every)
        model = lora_mod.GPT(lora_mod.Config.from_name(name, **kw))
        model.max_seq_length = SEQ_LEN
        if lora:
            lora_mod.mark_only_lora_as_trainable(model)
        if nf4:
            _quantize_linears(model)
        return model
    return build


def _quantize_linears(model) -> None:
    import torch
    from torch import nn

    from memlab.estimate.adapters import _replace
    from memlab.quant import Linear4bit

    for name, m in list(model.named_modules()):
        if isinstance(m, nn.Linear):
            _replace(model, name, Linear4bit.from_linear(m, torch.bfloat16, 64, False))


def step(lora: bool, fabric: bool):
    """litgpt's fit() step, finetune/lora.py (the head in 128-token chunks) or full.py (the head at once)."""
    from memlab.estimate.validate import fabric_outputs, litgpt_fit_loss

    cast = fabric_outputs if fabric else (lambda out: out)

    def lora_step(model, batch):
        return litgpt_fit_loss(cast(model(batch["input_ids"], lm_head_chunk_size=128)), batch["input_ids"])

    def full_step(model, batch):
        return litgpt_fit_loss(cast(model(batch["input_ids"])), batch["input_ids"])
    return lora_step if lora else full_step


def estimate_row(lora_mod: types.ModuleType, name: str, batch: int, accum: int, lora: dict | None, fabric: bool,
                 nf4: bool = False):
    """One row's estimate; ``nf4``: the QLoRA run (NF4 linears, bitsandbytes' paged AdamW, the NF4 rule of
    :mod:`memlab.estimate.cuda_rules` following bitsandbytes :data:`BNB_VERSION`)."""
    from memlab.estimate import cuda_rules, estimate_training_memory

    saved = cuda_rules.bnb_version
    if nf4:  # the trace's CUDA rules follow the installed bitsandbytes; the run's was older
        cuda_rules.bnb_version = lambda: (BNB_VERSION, "the run's")
    try:
        return estimate_training_memory(factory(lora_mod, name, lora, nf4), batch_size=batch, seq_len=SEQ_LEN,
                                        dtype="bf16-pure", optimizer="paged-adamw32bit" if nf4 else "adamw",
                                        step=step(lora is not None, fabric), device="cuda", gpu="rtx3090",
                                        grad_accum=accum)
    finally:
        cuda_rules.bnb_version = saved


def _commit(src: Path) -> str:
    import subprocess

    head = subprocess.run(["git", "-C", str(src), "rev-parse", "--short=8", "HEAD"], capture_output=True, text=True)
    return f"commit {head.stdout.strip()}" if head.returncode == 0 else f"source {src}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=Path, required=True, help="a litgpt source tree (checked out at bc3c337f)")
    ap.add_argument("--rows", default="", help="comma-separated config files (default: every row)")
    args = ap.parse_args(argv)
    wanted = {r for r in args.rows.split(",") if r}
    unknown = wanted - {r[0] for r in ROWS}
    if unknown:
        raise SystemExit(f"trace_litgpt: --rows {args.rows!r} is invalid (unknown {', '.join(sorted(unknown))}); "
                         f"allowed: {', '.join(r[0] for r in ROWS)}")
    lora_mod = load_litgpt(args.src)
    print(f"litgpt's own GPT and LoRA ({_commit(args.src)}) traced (memlab's callable route), batch x {SEQ_LEN}, "
          f"bf16-true, AdamW, CUDA target rtx3090 (sm 8.6, the A10G's chip); GB of 1e9 bytes")
    print(f"{'row':<22} {'published':>9} {'Fabric fp32 outputs':>21} {'bf16 outputs':>18}  peak in")
    for cfg, name, gb, batch, accum, lora in ROWS:
        if wanted and cfg not in wanted:
            continue
        t0 = time.perf_counter()
        ests = [estimate_row(lora_mod, name, batch, accum, lora, fabric) for fabric in (True, False)]
        cells = [f"{e.allocated_bytes / 1e9:>8.2f} GB {100 * (e.allocated_bytes / (gb * 1e9) - 1):>+6.1f}%" for e in ests]
        print(f"{cfg:<22} {gb:>6.2f} GB {cells[0]:>21} {cells[1]:>18}  {ests[0].peak_phase} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    print("Fabric's bf16-true plugin casts forward's outputs to float32 (HalfPrecision.convert_output, Lightning 2.2)")
    if not wanted:
        print(f"\nQLoRA rows (validate lists them as not expressible): every linear NF4 (no double quantization), "
              f"bitsandbytes {BNB_VERSION}'s MatMul4Bit keeping its input, paged AdamW, Fabric's fp32 outputs")
        for cfg, name, gb, batch, accum, lora in QLORA_ROWS:
            t0 = time.perf_counter()
            e = estimate_row(lora_mod, name, batch, accum, lora, fabric=True, nf4=True)
            print(f"{cfg:<22} {gb:>6.2f} GB {e.allocated_bytes / 1e9:>8.2f} GB "
                  f"{100 * (e.allocated_bytes / (gb * 1e9) - 1):>+6.1f}%  {e.peak_phase} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
