"""The planner's budgets: the device's (a size or a card, :func:`memlab.estimate.resolve_gpu`), the host's
(for offloaded optimizers), and what a card without bf16 allows."""
from __future__ import annotations

from typing import Any, Mapping

from memlab.core.units import GiB, format_bytes, parse_size
from memlab.plan.stack import canonical_precision


def resolve_budget(budget: Any, gpu: Any = None, device: str = "cuda") -> tuple[int, str]:
    """The device budget ``(bytes, label)`` of :func:`memlab.plan.plan`'s ``budget`` / ``gpu`` arguments.

    Args:
        budget: bytes, a size (``"24GiB"``, ``"24GB"``) or a card name; or None to use ``gpu``'s.
        gpu: a card (its memory minus the CUDA context).

    Raises:
        ValueError: neither given, or a value that is no size and no card.
    """
    from memlab.core import gpus
    from memlab.estimate import resolve_gpu

    if budget is None and gpu is None:
        raise ValueError("budget=None and gpu=None; allowed: a budget (bytes, '24GiB', '24GB') or a gpu "
                         f"({', '.join(gpus.gpu_names())})")
    if budget is not None:
        if isinstance(budget, str) and gpus.find_gpu(budget) is not None:
            label, usable = resolve_gpu(budget)
            return usable, label
        try:
            b = parse_size(budget, name="budget")
        except ValueError:
            raise ValueError(f"budget={budget!r} is invalid; allowed: a number of bytes, a size with a unit "
                             f"('24GiB' = 24 x 2**30, '24GB' = 24 x 10**9) or a card "
                             f"({', '.join(gpus.gpu_names())})") from None
        text = f"{format_bytes(b)}"
        if isinstance(budget, str) and budget.strip().lower().endswith(("kb", "mb", "gb", "tb")):
            text += f" ({budget.strip()}, decimal units)"
        return b, text + " budget"
    try:
        label, usable = resolve_gpu(gpu)
    except ValueError as exc:
        raise ValueError(str(exc)) from None
    return usable, label


DEFAULT_HOST_BUDGET = 64 * GiB  # where the machine's memory cannot be read: a workstation's, change it


def host_available_bytes() -> tuple[int, str]:
    """This machine's available memory, ``(bytes, where from)``: MemAvailable in /proc/meminfo (Linux), else
    psutil's ``virtual_memory().available`` if psutil is installed, else :data:`DEFAULT_HOST_BUDGET` (a stated
    default a learner can change)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "this machine's MemAvailable (/proc/meminfo)"
    except OSError:
        pass
    try:
        import psutil  # type: ignore[import-not-found]

        return int(psutil.virtual_memory().available), "this machine's available memory (psutil)"
    except Exception:  # noqa: BLE001  (not installed, or no reading on this platform)
        return DEFAULT_HOST_BUDGET, "memlab.plan.DEFAULT_HOST_BUDGET (this machine's memory could not be read)"


def allow_for_card(gpu: Any, allow: Mapping[str, Any] | None) -> tuple[Mapping[str, Any] | None, str | None]:
    """``(allow, note)`` for ``gpu``: a card without bf16 (memlab.core.gpus.CAPABILITIES) allows fp32 and fp16
    mixed precision, and a bf16 precision asked for it raises ValueError; other cards leave ``allow`` as it is."""
    from memlab.core import gpus

    caps = gpus.capability(gpu) if gpu is not None else None
    if caps is None or caps.bf16:
        return allow, None
    asked = list((allow or {}).get("precision", []))
    bad = [p for p in asked if canonical_precision(p) in ("bf16-mixed", "bf16-pure")]
    if bad:
        raise ValueError(f"allow['precision'] value {bad[0]!r} is invalid for gpu={gpu!r}: {caps.name} (compute "
                         f"capability {caps.sm[0]}.{caps.sm[1]}) has no bf16; allowed: 'fp32', 'fp16-mixed'")
    out = dict(allow or {})
    out.setdefault("precision", ["fp32", "fp16-mixed"])
    return out, (f"{caps.name}: compute capability {caps.sm[0]}.{caps.sm[1]}, no bf16 ({caps.source}): fp16 mixed "
                 "precision (fp16 autocast, fp32 master weights, dynamic loss scaling; chapter 03) instead of bf16")


