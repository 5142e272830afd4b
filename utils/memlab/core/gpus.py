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
    name: str
    smi_mib: int  # memory.total as nvidia-smi prints it
    source: str
    torch_total_bytes: int | None = None  # torch.cuda.get_device_properties().total_memory, where measured

    @property
    def total_bytes(self) -> int:
        """What PyTorch sees as the card's total (measured where known, else nvidia-smi's total)."""
        return self.torch_total_bytes if self.torch_total_bytes is not None else self.smi_mib * MiB

    @property
    def usable_bytes(self) -> int:
        """Total minus the stated CUDA-context reserve: what the caching allocator can get."""
        return self.total_bytes - CONTEXT_RESERVE_BYTES


GPUS: dict[str, GPU] = {
    "t4": GPU("Tesla T4 (16 GB)", 15360, "https://github.com/aws/sagemaker-huggingface-inference-toolkit/pull/103"),
    "l4": GPU("NVIDIA L4 (24 GB)", 23034, "https://github.com/NVIDIA/TensorRT-LLM/issues/2398"),
    "rtx3090": GPU("GeForce RTX 3090 (24 GB)", 24576, "https://github.com/noonghunna/club-3090/issues/1128"),
    "rtx4090": GPU("GeForce RTX 4090 (24 GB)", 24564, "https://github.com/RLinf/RLinf/issues/255"),
    "rtx5090": GPU("GeForce RTX 5090 (32 GB)", 32607, "https://github.com/noonghunna/club-3090/issues/1261"),
    # deviceQuery: "40339 MBytes (42298834944 bytes)" = 40339 MiB
    "a100-40gb": GPU("A100-SXM4-40GB", 40339, "https://github.com/bottlerocket-os/bottlerocket/pull/3873"),
    # an A800-SXM4-80GB (the A100 80GB board for China) on driver 535; older drivers printed 81252 MiB
    "a100-80gb": GPU("A100-SXM4-80GB", 81920, "https://github.com/dexmal/dexbotic/issues/41"),
    # nvidia-smi --query-gpu=name,memory.total on driver 595.71: "NVIDIA L40S, 46068 MiB"
    "l40s": GPU("NVIDIA L40S (48 GB)", 46068, "https://github.com/akash-network/provider-configs/pull/99"),
    "h100-80gb": GPU("H100 80GB HBM3", 81559, "measured: results/h100/estimator_probe_smi.txt",
                     torch_total_bytes=85_017_493_504),
}

ALIASES = {"a100": "a100-80gb", "h100": "h100-80gb", "4090": "rtx4090", "3090": "rtx3090", "5090": "rtx5090"}


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


# cards the planner knows, with the cards in GPUS and older ones without bf16 (fp16 mixed precision there)
CAPABILITIES: dict[str, Capability] = {
    "v100": Capability("Tesla V100", (7, 0)),
    "t4": Capability("Tesla T4", (7, 5)),
    "rtx2080ti": Capability("GeForce RTX 2080 Ti", (7, 5)),
    "a100-40gb": Capability("A100 40GB", (8, 0)),
    "a100-80gb": Capability("A100 80GB", (8, 0)),
    "rtx3090": Capability("GeForce RTX 3090", (8, 6)),
    "l4": Capability("NVIDIA L4", (8, 9)),
    "rtx4090": Capability("GeForce RTX 4090", (8, 9)),
    "l40s": Capability("NVIDIA L40S", (8, 9)),
    "h100-80gb": Capability("H100 80GB", (9, 0)),
    "rtx5090": Capability("GeForce RTX 5090", (12, 0)),
}


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
    """The names of every GPU preset, sorted."""
    return sorted(GPUS)


def find_gpu(name: str) -> GPU | None:
    """The preset called ``name`` (case-insensitive, aliases such as ``h100``), else None."""
    return GPUS.get(_key(name))


def suggest(name: str) -> str:
    """A hint for an unknown GPU name, the closest preset names and aliases:
    ``" (did you mean a, b?)"``, or ``""`` when nothing is close."""
    close = difflib.get_close_matches(str(name).lower(), list(GPUS) + list(ALIASES), n=3, cutoff=0.5)
    return f" (did you mean {', '.join(close)}?)" if close else ""
