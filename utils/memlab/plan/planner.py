""":func:`plan`: the cheapest training stacks whose traced peak fits a memory budget (chapter 07)."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping

from memlab.core.units import format_bytes, parse_size
from memlab.core.validation import (check_bool, check_choice, check_mapping, check_positive_int, check_schema,
                                    check_str, invalid)
from memlab.plan import memo
from memlab.plan.bounds import param_counts
from memlab.plan.budget import allow_for_card, host_available_bytes, resolve_budget
from memlab.plan.cost import CostModel, cost_model_for, model_shape, stack_cost
from memlab.plan.result import PlanResult, PlanRow
from memlab.plan.search import Search, enumerate_stacks, live_rows, run_search
from memlab.plan.stack import Stack, fidelity_tier
from memlab.plan.stacks import layer_count, resolve_config


def _check_arguments(args: dict[str, Any]) -> None:
    # every argument's rule, before any work (memlab.core.validation's one error format); torch-free

    def card(name: str, value: Any) -> None:
        if value is not None:
            check_str(name, value, "a card name such as 'rtx4090', or None")

    def size(name: str, value: Any) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, str))):
            raise invalid(name, value, "bytes (an int), a size such as '24GiB' or '24GB', a card name, or None")

    def host(name: str, value: Any) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, str))):
            raise invalid(name, value, "bytes (an int), a size such as '128GiB', 'auto' or None / 'none'")

    def cost_model(name: str, value: Any) -> None:
        if value is not None and not isinstance(value, CostModel):
            raise invalid(name, value, "a memlab.plan.CostModel (e.g. memlab.plan.GPU_SPECS['rtx4090']) or None")

    check_schema(args, {
        "batch_size": check_positive_int, "seq_len": check_positive_int, "top": check_positive_int,
        "lora_r": check_positive_int, "progress": check_bool, "prune": check_bool,
        "device": lambda n, v: check_choice(n, v, ("cuda", "cpu")),
        "loss": lambda n, v: check_choice(n, v, ("auto", "hf", "memlab")),
        "prefer": lambda n, v: check_choice(n, v, ("fidelity", "cost")),
        "config_overrides": lambda n, v: check_mapping(n, v, "a dict of config fields to change, or None"),
        "gpu": card, "budget": size, "host_budget": host, "cost": cost_model,
    })
    if args["gpu"] is not None and args["device"] != "cuda":
        raise ValueError(f"gpu={args['gpu']!r} with device={args['device']!r}: a card is a CUDA target; "
                         "allowed: device='cuda'")


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
    # Those that fit (by key, traced or not), those traced that do not (by peak), then the untraced.
    order = {"exceeds": 1, "dominated": 2, "not needed": 3}
    feasible = sorted((r for r in rows if r.fits and r.status in ("traced", "fits")), key=lambda r: r.key)
    over = sorted((r for r in rows if r.status == "traced" and not r.fits), key=lambda r: r.peak_bytes)
    rest = sorted((r for r in rows if r.status not in ("traced", "fits")), key=lambda r: (order[r.status], r.key))
    for r in rest:
        if r.status in ("dominated", "not needed"):
            r.fits = None
    return feasible + over + rest


def _cost_basis(cost: CostModel, device: str, given: bool) -> str:
    # one line on whose constants the relative costs use, plain where the device asked is not that card
    if device == "cpu":
        return (f"{cost.name}'s constants: the cost model is a GPU's (memlab has none for a CPU), so the costs order "
                f"the stacks as that card would run them, not as this CPU does")
    return f"{cost.name}'s constants" + ("" if given else " (the reference card: name a card with gpu= for its own)")


def plan(model: Any, budget: int | str | None = None, *, batch_size: int, seq_len: int, gpu: str | None = None,
         allow: Mapping[str, Any] | None = None, device: str = "cuda", top: int = 5, prefer: str = "fidelity",
         cost: CostModel | None = None, lora_r: int = 16, config_overrides: Mapping[str, Any] | None = None,
         host_budget: int | str | None = "auto", loss: str = "auto", progress: bool = False,
         prune: bool = True) -> PlanResult:
    """The cheapest training stacks of ``model`` whose estimated peak fits ``budget``.

    Each traced stack's peak is traced by :func:`memlab.estimate.estimate_step` on fake tensors
    (:func:`memlab.plan.estimate_stack`), never a formula. Ranking: ``prefer="fidelity"`` orders by
    :func:`fidelity_tier` first, then by :func:`stack_cost`; ``prefer="cost"`` by the cost alone. The search
    traces as little as it can (:func:`memlab.plan.search.run_search`): a candidate whose weights, gradients and
    optimizer state alone exceed the budget (:func:`memlab.plan.bounds.lower_bound`), or that needs at least the
    memory of a stack that did not fit (or, one micro-batch per step, that memory less the gradients an accumulating
    stack keeps: :func:`memlab.plan.bounds.accumulation_lower_bound`), is ruled out untraced; one that needs no more
    than a traced stack that fits is decided "fits" untraced (the pick is always traced); it stops after ``top``
    stacks fit. On two or more CPUs a second process traces ahead the stack the search likely asks for next
    (:mod:`memlab.plan.ahead`; ``MEMLAB_PLAN_AHEAD=0``: one process): the same rows, sooner.

    Args:
        model: a preset, a config.json path, a Hub model id (``org/name``: its config.json only) or a
            transformers config (the one resolver of :mod:`memlab.estimate.model`).
        budget: bytes, a size (``"24GiB"``, ``"24GB"`` = 24 x 10**9) or a card name; or None and ``gpu``.
        batch_size: the effective batch: a micro-batch m runs ``batch_size // m`` accumulation steps.
        gpu: a card: its memory minus the CUDA context, and its cost constants (:data:`GPU_SPECS`); a card
            without bf16 gets fp16 mixed precision instead of the bf16 recipes.
        allow: knob -> values to consider (:data:`DEFAULT_ALLOW` for the rest).
        device: "cuda" compares the reserved estimate with the budget; "cpu" the traced tensor peak. The costs are
            a GPU's on either (``result.cost_basis`` says whose).
        top: stop after this many stacks that fit.
        cost: the cost constants (default: ``gpu``'s or the reference card's).
        host_budget: bytes or a size bounding offloaded stacks' host memory; "auto": this machine's
            available memory (:func:`host_available_bytes`); None / "none": no bound.
        loss: the estimator's (see :func:`memlab.plan.estimate_stack`).
        progress: a progress bar (tqdm) while tracing.
        prune: False traces every candidate (no bound, no early stop): the exhaustive planner the pruned
            search is tested against; the same pick and peak, many more traces.

    Raises:
        ValueError, TypeError, FileNotFoundError: a bad argument, named with what is allowed.
    """
    t0 = time.perf_counter()
    args = dict(budget=budget, batch_size=batch_size, seq_len=seq_len, gpu=gpu, device=device, top=top, prefer=prefer,
                cost=cost, lora_r=lora_r, config_overrides=config_overrides, host_budget=host_budget, loss=loss,
                progress=progress, prune=prune, allow=allow)
    _check_arguments(args)
    host_budget_bytes, host_note = _host_budget(host_budget)
    key = memo.plan_key(model, {k: v for k, v in args.items() if k != "progress"})
    seen = memo.load(key, host_budget_bytes)
    if seen is not None:  # the same plan, made before (memlab.plan.memo): read, torch never imported
        return _remembered(seen, host_note, t0)
    from memlab.estimate import check_input_bounds

    check_input_bounds(batch_size, seq_len)  # before any work: a huge batch or sequence is refused here
    budget_bytes, budget_label = resolve_budget(budget, gpu, device)
    given = cost is not None
    cost, cost_note = cost_model_for(gpu if gpu is not None else budget) if cost is None else (cost, None)
    given = given or cost_note is None
    name, cfg = resolve_config(model, config_overrides)
    L = layer_count(cfg)
    from memlab.estimate import ModelSpec, check_positions

    check_positions(ModelSpec(name, config=cfg), seq_len, False)
    shape = model_shape(cfg, lora_r)
    stacks, notes = _stacks(cfg, L, batch_size, gpu, allow, device, host_note)
    if cost_note and device == "cuda":
        notes.append(cost_note)
    notes.append(f"cost constants: {cost.name}: {cost.source}; mfu {cost.mfu}, host {cost.host / 1e9:.0f} GB/s, "
                 f"kernel launch {cost.launch * 1e6:.0f} us x {cost.kernels_per_layer} per layer and pass (assumptions)")
    rows = _rows(stacks, shape, seq_len, cost, prefer)
    search = Search(name, cfg, L, seq_len=seq_len, device=device, lora_r=lora_r, loss=loss, budget=budget_bytes,
                    host_budget=host_budget_bytes, counts=param_counts(cfg, lora_r) if prune else None, prune=prune)
    _run(search, rows, top, progress)
    result = PlanResult(model=name, n_params=shape.all_params, batch_size=batch_size, seq_len=seq_len,
                        budget=budget_bytes, budget_label=budget_label, device=device, cost_model=cost,
                        rows=_ranked(rows), notes=notes, seconds=time.perf_counter() - t0, traces=search.traces,
                        prefer=prefer, fresh=search.fresh, cached=search.cached, below=search.below,
                        above=search.above, pruned=prune, cost_basis=_cost_basis(cost, device, given),
                        ahead=search.ahead_used, ahead_unused=search.ahead_unused)
    memo.save(key, result, search.host_compared, host_budget_bytes)
    return result


def _rows(stacks: list[Stack], shape: Any, seq_len: int, cost: CostModel, prefer: str) -> list[PlanRow]:
    # a row per stack with its cost and ranking key, in the ranking order
    rows = []
    for s in stacks:
        c, terms = stack_cost(s, shape, seq_len, cost)
        tier = fidelity_tier(s)
        rows.append(PlanRow(stack=s, cost=c, tier=tier, terms=terms, key=(tier if prefer == "fidelity" else 0, c)))
    return sorted(rows, key=lambda r: r.key)


def _remembered(seen: PlanResult, host_note: str | None, t0: float) -> PlanResult:
    # a plan read from the plan cache, with today's host-budget note and the time it took to read
    notes = [host_note if (host_note and n.startswith("host budget ")) else n for n in seen.notes]
    return dataclasses.replace(seen, notes=notes, seconds=time.perf_counter() - t0, fresh=0, cached=seen.traces,
                               remembered=True)


def _run(search: Search, rows: list[PlanRow], top: int, progress: bool) -> None:
    # the search over the ranked rows (numbered, the dominated set aside), or with prune=False every row traced
    if search.prune:
        live = live_rows(rows, search.L)
    else:
        live = rows
        for i, r in enumerate(rows):
            r.stack_id = i + 1
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(live), desc=f"plan {search.name}", unit="stack", leave=False)
    if search.prune:
        run_search(search, live, top, bar)
    else:
        for r in live:
            search.trace(r)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    for r in live:
        if r.status == "not needed":
            r.notes = "not traced: ranked below the stacks found"
