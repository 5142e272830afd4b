""":func:`plan`: the cheapest training stacks whose traced peak fits a memory budget (chapter 07)."""
from __future__ import annotations

import time
from typing import Any, Mapping

from memlab.core.units import format_bytes, parse_size
from memlab.core.validation import check_choice, check_positive_int
from memlab.plan.budget import allow_for_card, host_available_bytes, resolve_budget
from memlab.plan.cost import CostModel, cost_model_for, model_shape, stack_cost
from memlab.plan.result import PlanResult, PlanRow
from memlab.plan.search import Search, enumerate_stacks, live_rows, run_search
from memlab.plan.stack import Stack, fidelity_tier
from memlab.plan.stacks import layer_count, resolve_config


def _check_arguments(batch_size: int, seq_len: int, top: int, lora_r: int, device: str, loss: str, prefer: str,
                     gpu: Any) -> None:
    from memlab.estimate import check_input_bounds

    for arg, val in (("batch_size", batch_size), ("seq_len", seq_len), ("top", top), ("lora_r", lora_r)):
        check_positive_int(arg, val)
    check_input_bounds(batch_size, seq_len)  # before any work: a huge batch or sequence is refused here
    check_choice("device", device, ("cuda", "cpu"))
    check_choice("loss", loss, ("auto", "hf", "memlab"))
    check_choice("prefer", prefer, ("fidelity", "cost"))
    if gpu is not None and device != "cuda":
        raise ValueError(f"gpu={gpu!r} with device={device!r}: a card is a CUDA target; allowed: device='cuda'")


def _host_budget(host_budget: int | str | None) -> tuple[int | None, str | None]:
    # (bytes or None for no bound, a note saying where the default came from).
    if isinstance(host_budget, str) and host_budget == "auto":
        b, where = host_available_bytes()
        return b, (f"host budget {format_bytes(b)}: {where} (offloaded stacks keep their optimizer "
                   f"on the host; change it with host_budget= / --host-budget SIZE, or 'none' for no bound)")
    if host_budget is None or isinstance(host_budget, str) and host_budget.lower() == "none":
        return None, None
    try:
        return parse_size(host_budget), None
    except ValueError:
        raise ValueError(f"host_budget={host_budget!r} is invalid; allowed: bytes, a size such as '128GiB', "
                         "'auto' (this machine's available memory) or None / 'none' (no bound)") from None


def _stacks(cfg: Any, L: int, batch_size: int, gpu: Any, allow: Mapping[str, Any] | None,
            device: str, host_note: str | None) -> tuple[list[Stack], list[str]]:
    # The candidates and the notes on what is left out (the card's precisions, fp32 every-k with GQA).
    allow, card_note = allow_for_card(gpu, allow)
    stacks, notes = enumerate_stacks(batch_size, L, allow, device)
    notes += [n for n in (card_note, host_note) if n]
    heads, kv = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
    if device == "cuda" and heads and kv and kv < heads:
        # fp32 with grouped KV heads runs SDPA's math kernel on CUDA (T x T probabilities kept); the
        # estimator models that from the config, which a callable-built model (every-k) does not pass
        dropped = [s for s in stacks if s.precision == "fp32" and s.checkpointing == "every-k"]
        if dropped:
            stacks = [s for s in stacks if s not in dropped]
            notes.append(f"fp32 with every-k left out ({len(dropped)} stacks): with grouped KV heads CUDA runs the math "
                         f"attention kernel, which the estimator models only for a full fine-tune traced from the config")
    model_type = getattr(cfg, "model_type", None)
    from memlab.loss import SUPPORTED

    if model_type not in SUPPORTED:
        other = [s for s in stacks if s.loss != "default"]
        if other:
            stacks = [s for s in stacks if s.loss == "default"]
            notes.append(f"chunked and fused losses left out ({len(other)} stacks): memlab.loss.enable supports "
                         f"{', '.join(SUPPORTED)}, not {model_type!r}")
    if not stacks:
        raise ValueError(f"allow={dict(allow or {})!r} leaves no stack to try (LoRA/QLoRA need bf16-mixed or "
                         f"fp16-mixed and adamw or adamw-fused; flash needs device='cuda' and 16-bit)")
    return stacks, notes


def _ranked(rows: list[PlanRow]) -> list[PlanRow]:
    # Those that fit (by key), those traced that do not (by peak), then the untraced.
    order = {"traced": 0, "exceeds": 1, "dominated": 2, "not needed": 3}
    feasible = sorted((r for r in rows if r.fits and r.status == "traced"), key=lambda r: r.key)
    over = sorted((r for r in rows if r.status == "traced" and not r.fits), key=lambda r: r.peak_bytes)
    rest = sorted((r for r in rows if r.status != "traced"), key=lambda r: (order[r.status], r.key))
    for r in rest:
        if r.status in ("dominated", "not needed"):
            r.fits = None
    return feasible + over + rest


def plan(model: Any, budget: int | str | None = None, *, batch_size: int, seq_len: int, gpu: str | None = None,
         allow: Mapping[str, Any] | None = None, device: str = "cuda", top: int = 5, prefer: str = "fidelity",
         cost: CostModel | None = None, lora_r: int = 16, config_overrides: Mapping[str, Any] | None = None,
         host_budget: int | str | None = "auto", loss: str = "auto", progress: bool = False) -> PlanResult:
    """The cheapest training stacks of ``model`` whose estimated peak fits ``budget``.

    Each stack's peak is traced by :func:`memlab.estimate.estimate_step` on fake tensors
    (:func:`memlab.plan.estimate_stack`), never a formula. Ranking: ``prefer="fidelity"`` orders by
    :func:`fidelity_tier` first, then by :func:`stack_cost`; ``prefer="cost"`` by the cost alone. The search
    traces as little as it can (:func:`memlab.plan.search.run_search`): a candidate that needs at least
    the memory of a traced stack that did not fit is ruled out untraced, and it stops after ``top`` stacks fit.

    Args:
        model: a preset, a config.json path, a Hub model id (``org/name``: its config.json only) or a
            transformers config (the one resolver of :mod:`memlab.estimate.model`).
        budget: bytes, a size (``"24GiB"``, ``"24GB"`` = 24 x 10**9) or a card name; or None and ``gpu``.
        batch_size: the effective batch: a micro-batch m runs ``batch_size // m`` accumulation steps.
        gpu: a card: its memory minus the CUDA context, and its cost constants (:data:`GPU_SPECS`); a card
            without bf16 gets fp16 mixed precision instead of the bf16 recipes.
        allow: knob -> values to consider (:data:`DEFAULT_ALLOW` for the rest).
        device: "cuda" compares the reserved estimate with the budget; "cpu" the traced tensor peak.
        top: stop after this many stacks that fit.
        cost: the cost constants (default: ``gpu``'s or the reference card's).
        host_budget: bytes or a size bounding offloaded stacks' host memory; "auto": this machine's
            available memory (:func:`host_available_bytes`); None / "none": no bound.
        loss: the estimator's (see :func:`memlab.plan.estimate_stack`).

    Raises:
        ValueError, TypeError, FileNotFoundError: a bad argument, named with what is allowed.
    """
    t0 = time.perf_counter()
    _check_arguments(batch_size, seq_len, top, lora_r, device, loss, prefer, gpu)
    budget_bytes, budget_label = resolve_budget(budget, gpu, device)
    host_budget_bytes, host_note = _host_budget(host_budget)
    cost, cost_note = cost_model_for(gpu if gpu is not None else budget) if cost is None else (cost, None)
    name, cfg = resolve_config(model, config_overrides)
    L = layer_count(cfg)
    from memlab.estimate import ModelSpec, check_positions

    check_positions(ModelSpec(name, config=cfg), seq_len, False)
    shape = model_shape(cfg, lora_r)
    stacks, notes = _stacks(cfg, L, batch_size, gpu, allow, device, host_note)
    if cost_note:
        notes.append(cost_note)
    notes.append(f"cost constants: {cost.name}: {cost.source}; mfu {cost.mfu}, host {cost.host / 1e9:.0f} GB/s, "
                 f"kernel launch {cost.launch * 1e6:.0f} us x {cost.kernels_per_layer} per layer and pass (assumptions)")
    rows = []
    for s in stacks:
        c, terms = stack_cost(s, shape, seq_len, cost)
        tier = fidelity_tier(s)
        rows.append(PlanRow(stack=s, cost=c, tier=tier, terms=terms, key=(tier if prefer == "fidelity" else 0, c)))
    rows.sort(key=lambda r: r.key)
    search = Search(name, cfg, L, seq_len=seq_len, device=device, lora_r=lora_r, loss=loss, budget=budget_bytes,
                    host_budget=host_budget_bytes)
    live = live_rows(rows, L)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(live), desc=f"plan {name}", unit="stack", leave=False)
    run_search(search, live, top, bar)
    if bar is not None:
        bar.close()
    for r in live:
        if r.status == "not needed":
            r.notes = "not traced: ranked below the stacks found"
    return PlanResult(model=name, n_params=shape.all_params, batch_size=batch_size, seq_len=seq_len,
                      budget=budget_bytes, budget_label=budget_label, device=device, cost_model=cost,
                      rows=_ranked(rows), notes=notes, seconds=time.perf_counter() - t0, traces=search.traces,
                      prefer=prefer)
