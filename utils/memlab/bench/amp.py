"""``memlab bench amp``: peak memory and speed of fp32 vs fp16 + loss scaler vs bf16 training steps.

For TinyGPT and the tiny transformers Llama, one full training step (forward, backward, AdamW
step) per recipe:

* fp32: no autocast;
* fp16 + GradScaler: autocast fp16 with ``torch.amp.GradScaler`` (the production reference);
* fp16 + DynamicLossScaler: the same with ``memlab.amp.DynamicLossScaler`` (from scratch);
* bf16: autocast bf16 over fp32 weights (bf16-mixed, :mod:`memlab.core.vocab`), no scaler;
* fp16 master weights: a pure fp16 model with fp32 master weights (``memlab.amp.MasterWeights``)
  and ``DynamicLossScaler``.

Peak memory is measured with ``memlab.profiler.MemoryTracker`` (every device; on CUDA also
``torch.cuda.max_memory_allocated``). Speed is only measured on CUDA: a CPU has no 16-bit matrix
units in PyTorch's default kernels (fp16 matmuls are emulated through fp32 and run several times
slower than fp32), so a CPU timing would compare kernels, not precisions.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable

import torch

from memlab.bench import device_name, interleaved_medians, table
from memlab.core.units import MiB
from memlab.core.validation import check_choice, check_positive_int

RECIPES = ("fp32", "fp16 + GradScaler", "fp16 + DynamicLossScaler", "bf16", "fp16 master weights")
MODELS = ("tinygpt", "tiny_llama")


def _build(name: str, device: torch.device, seq_len: int) -> torch.nn.Module:
    from memlab.models import TinyGPT, TinyGPTConfig, tiny_llama

    check_choice("model", name, MODELS)
    torch.manual_seed(0)
    if name == "tinygpt":
        return TinyGPT(TinyGPTConfig(block_size=max(seq_len, 128))).to(device)
    return tiny_llama(max_position_embeddings=max(seq_len, 256)).to(device)


def make_step(model_name: str, recipe: str, device: torch.device, seq_len: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[torch.Tensor, torch.Tensor], Any]]:
    """One training step of a model (one of :data:`MODELS`) under a precision recipe (one of :data:`RECIPES`).

    ``seq_len`` is the longest sequence the model must take.

    Returns:
        ``(model, optimizer, step)``; ``step(x, y)`` runs forward, backward and the update.

    Raises:
        ValueError: an unknown model or recipe.
    """
    from memlab import amp
    from memlab.models import lm_loss

    check_choice("recipe", recipe, RECIPES)
    model = _build(model_name, device, seq_len)
    mw = None
    if recipe == "fp16 master weights":
        mw = amp.MasterWeights(model, lambda ps: torch.optim.AdamW(ps, lr=1e-4))
        opt = mw.optimizer
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler: Any = None
    if recipe == "fp16 + GradScaler":
        scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)
    elif recipe in ("fp16 + DynamicLossScaler", "fp16 master weights"):
        scaler = amp.DynamicLossScaler(init_scale=2.0**10)
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16 master weights": None}.get(recipe, torch.float16)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = lm_loss(model, x, y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if mw is not None:
            mw.step(scaler)
        elif scaler is not None:
            scaler.step(opt)
        else:
            opt.step()
        if scaler is not None:
            scaler.update()
        opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)

    return model, opt, step


def measure(model_name: str, recipe: str, device: torch.device, batch_size: int, seq_len: int, repeat: int) -> dict[str, Any]:
    """Peak memory (and on CUDA the speed) of one step of :func:`make_step`, after three warm-up steps.

    ``repeat``: unused (main times the recipes' steps interleaved, ``repeat`` rounds).

    Returns:
        ``peak`` and ``breakdown`` (MemoryTracker's, at the peak); on CUDA also ``cuda_peak`` and
        ``step``, the call that runs one more step (to time).
    """
    from memlab.profiler import MemoryTracker

    model, opt, step = make_step(model_name, recipe, device, seq_len)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (batch_size, seq_len), generator=gen).to(device)
    y = torch.randint(0, 256, (batch_size, seq_len), generator=gen).to(device)
    for _ in range(3):  # Adam's state exists and the scaler settled before measuring
        step(x, y)
    with MemoryTracker(model, opt, device=device.type) as tracker:
        step(x, y)
    out: dict[str, Any] = {"peak": tracker.peak_bytes, "breakdown": tracker.breakdown("peak")}
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        step(x, y)
        torch.cuda.synchronize()
        out["cuda_peak"] = torch.cuda.max_memory_allocated(device)
        out["step"] = lambda: step(x, y)  # timed by main, interleaved with the other recipes
    return out


def main(argv: list[str] | None = None) -> int:
    """``memlab bench amp``: one table per model, a row per recipe; returns 0."""
    from memlab.config import DEVICE, SMALL, bf16_supported

    ap = argparse.ArgumentParser(prog="memlab bench amp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tinygpt,tiny_llama", help="comma-separated: tinygpt, tiny_llama")
    ap.add_argument("--batch-size", type=int, default=None, help="default: 32 on CUDA, 4 on CPU")
    ap.add_argument("--seq-len", type=int, default=None, help="default: 256 on CUDA, 64 on CPU")
    ap.add_argument("--repeat", type=int, default=10, help="interleaved rounds of timed steps (CUDA), medians reported")
    ap.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated subset of: {', '.join(RECIPES)}")
    args = ap.parse_args(argv)
    cuda = DEVICE.type == "cuda"
    batch = args.batch_size or (4 if SMALL or not cuda else 32)
    seq = args.seq_len or (64 if SMALL or not cuda else 256)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    try:  # argparse's usage line, then the one memlab error format
        for name, v in (("--batch-size", batch), ("--seq-len", seq), ("--repeat", args.repeat)):
            check_positive_int(name, v)
        for m in models:
            check_choice("--models", m, MODELS)
        for r in recipes:
            check_choice("--recipes", r, RECIPES)
    except ValueError as exc:
        ap.error(str(exc))
    if not bf16_supported(DEVICE) and "bf16" in recipes:
        print(f"bf16 is not supported on {device_name(DEVICE)}: skipping the bf16 recipe")
        recipes.remove("bf16")

    for model_name in models:
        results = {r: measure(model_name, r, DEVICE, batch, seq, args.repeat) for r in recipes}
        if cuda:  # the recipes in turns, round by round: a busy moment slows every recipe alike
            secs = interleaved_medians({r: res.pop("step") for r, res in results.items()}, args.repeat, DEVICE, warmup=2)
            for r, res in results.items():
                res["seconds"], res["tokens_per_s"] = secs[r], batch * seq / secs[r]
        base = results.get("fp32") or next(iter(results.values()))
        header = ["recipe", "peak (MiB)", "vs fp32", "activations (MiB)", "params+grads+opt (MiB)"]
        if cuda:
            header += ["cuda peak (MiB)", "step (ms)", "tokens/s", "speed vs fp32"]
        rows = []
        for r, res in results.items():
            b = res["breakdown"]
            row: list[Any] = [r, res["peak"] / MiB, res["peak"] / base["peak"], b["activations"] / MiB,
                              (b["parameters"] + b["gradients"] + b["optimizer"]) / MiB]
            if cuda:
                row += [res["cuda_peak"] / MiB, res["seconds"] * 1e3, res["tokens_per_s"], base["seconds"] / res["seconds"]]
            rows.append(row)
        print(table(f"memlab bench amp: {model_name}, batch {batch} x seq {seq}, one AdamW training step", header, rows, DEVICE))
        if cuda and "fp16 + GradScaler" in results and "fp16 + DynamicLossScaler" in results:
            ratio = results["fp16 + DynamicLossScaler"]["seconds"] / results["fp16 + GradScaler"]["seconds"]
            print(f"from scratch vs production: DynamicLossScaler step time / GradScaler step time = {ratio:.2f}")
        print()
    if not cuda:
        print("speed: not measured on CPU. PyTorch's CPU kernels have no fast fp16 path (fp16 matmuls run\n"
              "through fp32 conversions and are several times slower than fp32), and bf16 speed depends on\n"
              "the CPU's AVX-512/AMX support, so a CPU timing compares kernels, not precisions. Run on a GPU\n"
              "for step time and tokens/s.")
    return 0
