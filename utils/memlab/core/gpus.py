"""GPUs by name and true size: what the driver reports, and what a training step can use.

A card sold as "N GB" reports its size in MiB (``nvidia-smi``); the totals below are ``nvidia-smi``'s,
each from the public log or measurement named in ``source``, and PyTorch's own total
(``torch.cuda.get_device_properties(0).total_memory``) is given and used where it was measured.
Not all of it is PyTorch's: the CUDA context (driver state, lazily loaded kernels, the cuBLAS
handle) takes memory outside the caching allocator, ``total - free - reserved`` from
``torch.cuda.mem_get_info()``. :data:`CONTEXT_RESERVE_BYTES` is one measured figure of it; it varies
with the driver, the CUDA version and the libraries loaded (measure yours with ``torch.cuda.mem_get_info``).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass

from memlab.core.units import GiB, MiB  # noqa: F401  (memlab.core.gpus.MiB/GiB: old names)

# measured: total - free - reserved after the first matmul, H100 80GB HBM3, driver 580, torch 2.11 + CUDA 13
# (results/h100/estimator_probe.json: after_matmul.context = 718,077,952 B; 619 MiB after the first tensor)
CONTEXT_RESERVE_BYTES = 718_077_952
CONTEXT_RESERVE_SOURCE = "measured on an H100 80GB, torch 2.11, CUDA 13 (results/h100/estimator_probe.json)"


@dataclass(frozen=True)
class GPU:
    """One card: its name, its memory as ``nvidia-smi`` prints it (``smi_mib``, MiB), where that figure is
    from, PyTorch's own total where measured, and its CUDA compute capability ``sm``."""
    name: str
    smi_mib: int  # memory.total as nvidia-smi prints it (or torch's total in MiB where that is the source)
    source: str
    torch_total_bytes: int | None = None  # torch.cuda.get_device_properties().total_memory, where measured
    sm: tuple[int, int] = (0, 0)  # compute capability (NVIDIA CUDA GPUs list, developer.nvidia.com/cuda-gpus)

    @property
    def total_bytes(self) -> int:
        """What PyTorch sees as the card's total (measured where known, else nvidia-smi's total)."""
        return self.torch_total_bytes if self.torch_total_bytes is not None else self.smi_mib * MiB

    @property
    def usable_bytes(self) -> int:
        """Total minus the stated CUDA-context reserve: what the caching allocator can get."""
        return self.total_bytes - CONTEXT_RESERVE_BYTES


_YOLO = ("torch.cuda.get_device_properties(0) as printed in public YOLOv5 set-up logs "
         "(_CudaDeviceProperties(..., total_memory=%dMB): MiB, rounded down)")

#: THE table of cards: every list of cards (``memlab estimate --help``, ``memlab plan --help``, every error,
#: the API's ``gpu=``) is derived from it. Memory from the source named; compute capability from NVIDIA's list.
GPUS: dict[str, GPU] = {
    # torch's own total for a Tesla V100-SXM2-16GB (sm 7.0, no bf16)
    "v100": GPU("Tesla V100-SXM2-16GB", 16160, _YOLO % 16160, 16160 * MiB, (7, 0)),
    "t4": GPU("Tesla T4 (16 GB)", 15360, "https://github.com/aws/sagemaker-huggingface-inference-toolkit/pull/103",
              sm=(7, 5)),
    # torch's own total for a GeForce RTX 2080 Ti (sm 7.5, no bf16)
    "rtx2080ti": GPU("GeForce RTX 2080 Ti (11 GB)", 11019, _YOLO % 11019, 11019 * MiB, (7, 5)),
    # AWS g5 instances' card (GA102, as the RTX 3090); nvidia-smi on driver 535: "8722MiB / 23028MiB"
    "a10g": GPU("NVIDIA A10G (24 GB)", 23028, "https://github.com/NVIDIA/DCGM/issues/232", sm=(8, 6)),
    "l4": GPU("NVIDIA L4 (24 GB)", 23034, "https://github.com/NVIDIA/TensorRT-LLM/issues/2398", sm=(8, 9)),
    "rtx3090": GPU("GeForce RTX 3090 (24 GB)", 24576, "https://github.com/noonghunna/club-3090/issues/1128", sm=(8, 6)),
    "rtx4090": GPU("GeForce RTX 4090 (24 GB)", 24564, "https://github.com/RLinf/RLinf/issues/255", sm=(8, 9)),
    "rtx5090": GPU("GeForce RTX 5090 (32 GB)", 32607, "https://github.com/noonghunna/club-3090/issues/1261",
                   sm=(12, 0)),
    # deviceQuery: "40339 MBytes (42298834944 bytes)" = 40339 MiB
    "a100-40gb": GPU("A100-SXM4-40GB", 40339, "https://github.com/bottlerocket-os/bottlerocket/pull/3873", sm=(8, 0)),
    # an A800-SXM4-80GB (the A100 80GB board for China) on driver 535; older drivers printed 81252 MiB
    "a100-80gb": GPU("A100-SXM4-80GB", 81920, "https://github.com/dexmal/dexbotic/issues/41", sm=(8, 0)),
    # nvidia-smi --query-gpu=name,memory.total on driver 595.71: "NVIDIA L40S, 46068 MiB"
    "l40s": GPU("NVIDIA L40S (48 GB)", 46068, "https://github.com/akash-network/provider-configs/pull/99", sm=(8, 9)),
    "h100-80gb": GPU("H100 80GB HBM3", 81559, "measured: results/h100/estimator_probe_smi.txt",
                     torch_total_bytes=85_017_493_504, sm=(9, 0)),
    # nvidia-smi on a lent H200, driver 580.159.04: "0MiB / 143771MiB"; torch's total printed as 139.8 GiB (describe(),
    # one decimal: not exact enough to store as bytes)
    "h200": GPU("NVIDIA H200 (141 GB)", 143771, "measured: results/h200/2026-11-28/env.log", sm=(9, 0)),
}

ALIASES = {"a100": "a100-80gb", "h100": "h100-80gb", "4090": "rtx4090", "3090": "rtx3090", "5090": "rtx5090",
           "2080ti": "rtx2080ti", "v100-16gb": "v100"}


@dataclass(frozen=True)
class Capability:
    """What a card's tensor cores compute: its CUDA compute capability ``sm`` and whether it has bf16
    (compute capability 8.0 and later: Ampere, Ada, Hopper, Blackwell)."""
    name: str
    sm: tuple[int, int]
    source: str = "NVIDIA CUDA GPUs list, developer.nvidia.com/cuda-gpus"

    @property
    def bf16(self) -> bool:
        return self.sm >= (8, 0)


# derived from GPUS (one table): the compute capability of every card
CAPABILITIES: dict[str, Capability] = {k: Capability(g.name, g.sm) for k, g in GPUS.items()}


def _key(name: str) -> str:
    # a card's name as the tables spell it: lower case, dashes, no spaces, aliases resolved
    key = str(name).strip().lower().replace("_", "-").replace(" ", "")
    return ALIASES.get(key, key)


def capability(name: str) -> Capability | None:
    """The compute capability of the card called ``name`` (aliases as :func:`find_gpu`), or None
    for an unknown card."""
    key = _key(name)
    return CAPABILITIES.get(key) or CAPABILITIES.get(key.split("-")[0])


def gpu_names() -> list[str]:
    """The names of every card of :data:`GPUS`, sorted: the one list ``--help``, errors and the API give."""
    return sorted(GPUS)


def find_gpu(name: str) -> GPU | None:
    """The preset called ``name`` (case-insensitive, aliases such as ``h100``), else None."""
    return GPUS.get(_key(name))


def suggest(name: str) -> str:
    """A hint for an unknown GPU name, the closest preset names and aliases:
    ``" (did you mean a, b?)"``, or ``""`` when nothing is close."""
    close = difflib.get_close_matches(str(name).lower(), list(GPUS) + list(ALIASES), n=3, cutoff=0.5)
    return f" (did you mean {', '.join(close)}?)" if close else ""


#: sizes ``gpu=`` accepts: from 1 GiB (a bare ``0.4`` is a mistake, not a card) to 16 TiB (no card comes near)
MIN_GPU_BYTES = GiB
MAX_GPU_BYTES = 16 * 1024 * GiB


def allowed_text() -> str:
    """What ``gpu=`` / ``--gpu`` accepts, in words: every card of :data:`GPUS` and a size."""
    return (f"a card of memlab.core.gpus ({', '.join(gpu_names())}) or a size such as 24GiB (24 x 2**30) "
            f"or 24GB (24 x 10**9)")


def parse_gpu(value: object, name: str = "gpu") -> tuple[str | None, int]:
    """``(card key or None, total bytes)`` of a card name (aliases as :func:`find_gpu`) or a size (``"24GiB"``,
    ``"24GB"``, an int of bytes): the one reading of ``gpu=`` for the API and ``--gpu`` for the CLI (torch-free).

    Raises:
        ValueError: ``name=value is invalid; allowed:`` the cards of :data:`GPUS` and sizes, with the closest card.
    """
    from memlab.core.units import parse_size
    from memlab.core.validation import invalid

    if isinstance(value, str):
        key = _key(value)
        if key in GPUS:
            return key, GPUS[key].total_bytes
    total = None
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        try:
            total = parse_size(value, name=name)
        except (ValueError, OverflowError):
            total = None
    if total is None:
        raise invalid(name, value, allowed_text() + (suggest(value) if isinstance(value, str) else ""))
    if not MIN_GPU_BYTES <= total <= MAX_GPU_BYTES:
        raise invalid(name, value, f"{allowed_text()}, from 1 GiB to 16 TiB ({total:,} bytes is "
                                   f"{'less than 1 GiB' if total < MIN_GPU_BYTES else 'more than 16 TiB'})")
    return None, total
