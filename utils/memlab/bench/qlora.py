"""``memlab bench qlora``: memlab's NF4 against bitsandbytes, and the memory of full / LoRA / QLoRA steps.

Three tables, each measured in one run on the current device:

1. NF4 quantize and dequantize of one weight matrix: memlab.quant vs bitsandbytes.functional
   (medians of interleaved rounds, bytes stored, and whether the bytes are equal; target: >= 0.5x
   bitsandbytes' speed, printed as TARGET MET / MISSED, exit 1 on a miss with ``--strict``);
2. a 4-bit linear layer's forward: memlab.quant.Linear4bit vs bitsandbytes.nn.Linear4bit;
3. one training step of tiny_llama (forward, backward, AdamW step): full fine-tune in fp32,
   LoRA (memlab.quant.lora on the fp32 model) and QLoRA (memlab.quant.lora.qlora_model: NF4 base, bf16
   compute, fp32 adapters), peak and breakdown measured with memlab.profiler.MemoryTracker.
"""
from __future__ import annotations

import argparse
import copy
from typing import Any

import torch
from torch import nn

from memlab.bench import add_strict, device_name, interleaved_medians, report_targets, table
from memlab.core.units import MiB


NF4_TARGET = 0.5  # memlab's NF4 quantize / dequantize speed vs bitsandbytes' (issue 42)


def _bnb():
    try:
        import bitsandbytes
        import bitsandbytes.functional as F
    except Exception as exc:  # noqa: BLE001
        raise SystemExit(f"memlab bench qlora needs bitsandbytes: {exc}") from None
    return bitsandbytes, F


def nf4_dequantize_times(ours: tuple[torch.Tensor, torch.Tensor], ref_packed: torch.Tensor, ref_state: Any,
                         shape: Any, dtype: torch.dtype, repeat: int, device: Any) -> tuple[float, float]:
    """Median seconds of memlab's NF4 dequantize of ``ours`` (packed, absmax) and bitsandbytes' of
    ``ref_packed`` / ``ref_state``, interleaved round by round (one warm-up round)."""
    from memlab import quant

    _, F = _bnb()
    med = interleaved_medians({"ours": lambda: quant.dequantize_nf4(ours[0], ours[1], shape, dtype),
                               "ref": lambda: F.dequantize_4bit(ref_packed, ref_state)}, repeat, device, warmup=1)
    return med["ours"], med["ref"]


def nf4_dequantize_ratio(size: int, dtype: torch.dtype, repeat: int, device: Any = "cpu") -> tuple[float, float]:
    """(memlab seconds, bitsandbytes seconds) to dequantize a random ``size`` x ``size`` NF4 matrix (blocksize 64)."""
    from memlab import quant

    _, F = _bnb()
    w = torch.randn((size, size), generator=torch.Generator().manual_seed(0)).to(dtype).to(device)
    ref_packed, st = F.quantize_4bit(w, blocksize=64, quant_type="nf4")
    return nf4_dequantize_times(quant.quantize_nf4(w), ref_packed, st, w.shape, dtype, repeat, device)


def bench_nf4(rows_cols: tuple[int, int], dtype: torch.dtype, device: torch.device, repeat: int) -> list[list[Any]]:
    """NF4 quantize and dequantize of one random matrix (float32, float16 or bfloat16), memlab.quant against
    bitsandbytes.functional; ``repeat`` timed runs per operation (the median is shown).

    Returns:
        Two table rows (quantize, dequantize): times in ms, speed ratio, Gweights/s, bytes, bit-exactness.
    """
    from memlab import quant

    _, F = _bnb()
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(rows_cols, generator=gen).to(dtype).to(device)
    ours = quant.quantize_nf4(w)
    ref_packed, st = F.quantize_4bit(w, blocksize=64, quant_type="nf4")
    same = torch.equal(ours[0], ref_packed) and torch.equal(ours[1], st.absmax)
    t_q, t_q_ref = interleaved_medians({"ours": lambda: quant.quantize_nf4(w),
                                        "ref": lambda: F.quantize_4bit(w, blocksize=64, quant_type="nf4")},
                                       repeat, device, warmup=1).values()
    deq = quant.dequantize_nf4(ours[0], ours[1], w.shape, dtype)
    ref_deq = F.dequantize_4bit(ref_packed, st).reshape(-1)
    same_d = torch.equal(deq.reshape(-1), ref_deq)
    if not same_d:  # bitsandbytes 0.50's CPU kernel is wrong at some shapes on AVX-512 CPUs: say whose values are right
        codes = quant.unpack_nibbles(ref_packed, w.numel()).cpu()
        definition = (quant.nf4_codebook()[codes] * st.absmax.cpu().float().repeat_interleave(64)[: w.numel()]).to(dtype)
        if torch.equal(deq.reshape(-1).cpu(), definition) and not torch.equal(ref_deq.cpu(), definition):
            same_d = "bnb kernel wrong"
    t_d, t_d_ref = nf4_dequantize_times(ours, ref_packed, st, w.shape, dtype, repeat, device)
    b_ours = ours[0].numel() + 4 * ours[1].numel()
    b_ref = ref_packed.numel() * ref_packed.element_size() + st.absmax.numel() * 4
    n = w.numel()
    return [
        ["quantize", t_q * 1e3, t_q_ref * 1e3, t_q_ref / t_q, n / t_q / 1e9, b_ours, b_ref, "yes" if same else "NO"],
        ["dequantize", t_d * 1e3, t_d_ref * 1e3, t_d_ref / t_d, n / t_d / 1e9, b_ours, b_ref,
         same_d if isinstance(same_d, str) else "yes" if same_d else "NO"],
    ]


def bench_linear(shape: tuple[int, int], batch: int, device: torch.device, repeat: int) -> list[list[Any]]:
    """One Linear4bit forward (double quant) of ``shape`` ``(out_features, in_features)`` on ``batch`` input
    rows, memlab.quant against bitsandbytes.nn; ``repeat`` timed runs (the median is shown).

    Returns:
        One table row: times in ms, speed ratio and the largest absolute difference of the outputs.
    """
    from memlab import quant

    bnb, _ = _bnb()
    torch.manual_seed(0)
    lin = nn.Linear(shape[1], shape[0])
    rows = []
    for cd in (torch.float32, torch.bfloat16):
        ref = bnb.nn.Linear4bit(shape[1], shape[0], bias=True, compute_dtype=cd, compress_statistics=True, quant_type="nf4")
        ref.weight = bnb.nn.Params4bit(lin.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                       compress_statistics=True, blocksize=64)
        ref.bias = nn.Parameter(lin.bias.data.clone())
        ref = ref.to(device)
        ours = quant.Linear4bit.from_linear(lin, compute_dtype=cd, double_quant=True).to(device)
        x = torch.randn(batch, shape[1], device=device)
        with torch.no_grad():
            t, t_ref = interleaved_medians({"ours": lambda: ours(x), "ref": lambda: ref(x)}, repeat, device,
                                           warmup=1).values()
            err = (ours(x) - ref(x)).abs().max().item()
        rows.append([f"forward, compute {str(cd).replace('torch.', '')}", t * 1e3, t_ref * 1e3, t_ref / t, err])
    return rows


def bench_steps(device: torch.device, batch: int, seq: int) -> list[list[Any]]:
    """The second training step of tiny_llama under full fine-tuning, LoRA and QLoRA, tracked.

    Returns:
        One table row per recipe: trainable parameters, stored model, peak and its breakdown, in MiB.
    """
    from memlab.quant import lora
    from memlab.models import lm_loss, tiny_llama
    from memlab.profiler import MemoryTracker

    torch.manual_seed(0)
    base = tiny_llama()
    rows = []
    for recipe in ("full fine-tune (fp32, AdamW)", "LoRA r=8 (fp32 base)", "QLoRA r=8 (NF4 base, bf16 compute)"):
        model = copy.deepcopy(base)
        if recipe.startswith("LoRA"):
            lora.add_lora(model, r=8, alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                "up_proj", "down_proj"])
        elif recipe.startswith("QLoRA"):
            lora.qlora_model(model, r=8, alpha=16)
        model = model.to(device)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4)
        x = torch.randint(0, 256, (batch, seq), device=device)
        y = torch.randint(0, 256, (batch, seq), device=device)
        stored = lora.model_storage_bytes(model)
        lm_loss(model, x, y).backward()  # a first step so that the optimizer state exists
        opt.step()
        opt.zero_grad(set_to_none=True)
        tracker = MemoryTracker(model, opt)
        with tracker:
            loss = lm_loss(model, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        b = tracker.breakdown("peak")
        rows.append([recipe, sum(p.numel() for p in params), stored / MiB, tracker.peak_bytes / MiB,
                     b.get("parameters", 0) / MiB, b.get("gradients", 0) / MiB, b.get("optimizer", 0) / MiB,
                     b.get("activations", 0) / MiB])
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its three tables and the targets (NF4 quantize and dequantize >= 0.5x
    bitsandbytes' speed, issue 42); exit code 0, or 1 with ``--strict`` when a target is missed."""
    from memlab.config import DEVICE, SMALL

    ap = argparse.ArgumentParser(prog="memlab bench qlora", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=None, help="weight matrix is size x size (default 4096 on CUDA, 1024 small)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--skip-steps", action="store_true", help="leave out the training-step table")
    add_strict(ap)
    args = ap.parse_args(argv)
    size = args.size or (1024 if SMALL else 4096)
    if size < 1 or args.repeat < 1:
        ap.error("--size and --repeat must be >= 1")
    header = ["op", "memlab (ms)", "bitsandbytes (ms)", "speed vs bnb", "Gweights/s", "bytes memlab", "bytes bnb", "bit-exact"]
    checks: list[tuple[str, float | None, bool]] = []
    for dtype in (torch.float32, torch.bfloat16):
        rows = bench_nf4((size, size), dtype, DEVICE, args.repeat)
        for r in rows:
            name = str(dtype).replace("torch.", "")
            checks.append((f"NF4 {r[0]} {size}x{size} {name} >= {NF4_TARGET:g}x bitsandbytes' speed "
                           f"(shown: speed ratio)", r[3], r[3] >= NF4_TARGET))
        print(table(f"memlab bench qlora: NF4 blocksize 64 of a {size}x{size} {str(dtype).replace('torch.', '')} matrix",
                    header, rows, DEVICE))
        print()
    rows = bench_linear((size, size), 16, DEVICE, args.repeat)
    print(table(f"memlab bench qlora: Linear4bit({size}, {size}) forward, batch 16, double quant",
                ["op", "memlab (ms)", "bitsandbytes (ms)", "speed vs bnb", "max abs diff"], rows, DEVICE))
    if DEVICE.type == "cpu":
        print("max abs diff: bitsandbytes' CPU kernel picks some 8-bit codes of the double-quantized scales one level "
              "off\nthe nearest (a lookup); given the same codes the forward is bitwise equal (memlab's tests check it).")
    else:  # the CPU explanation is not known to hold for bitsandbytes' CUDA kernels (an H200, 2026-11-28)
        print("max abs diff: not yet explained on CUDA; where 'bit-exact' above says NO, the two quantize differently\n"
              "(on an H200, 2026-11-28: fp32 input not bit-exact, bf16 bit-exact)")
    print()
    if not args.skip_steps:
        rows = bench_steps(DEVICE, 4, 64 if SMALL else 256)
        print(table("memlab bench qlora: tiny_llama, second training step (batch 4), MemoryTracker peak and its breakdown",
                    ["recipe", "trainable", "stored model (MiB)", "peak (MiB)", "params (MiB)", "grads (MiB)", "optimizer (MiB)",
                     "activations (MiB)"], rows, DEVICE))
    print(f"\nspeed vs bnb > 1: memlab faster. Device: {device_name(DEVICE)}")
    return report_targets(checks, DEVICE, strict=args.strict)
