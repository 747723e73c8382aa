"""Device choice and memory figures, for the GPU and for the CPU process alike."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import psutil
import torch


def choose_device(name: str = "auto") -> torch.device:
    """``auto`` picks CUDA when present, else the CPU; anything else is taken as a torch device name."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    return device


def set_threads(n: int) -> None:
    """Pin torch's intra-op thread count (0 leaves the default); the harness records what it set."""
    if n > 0:
        torch.set_num_threads(n)


def memory_snapshot(device: torch.device | None = None) -> dict[str, int]:
    """Bytes in use now: the process's resident memory, and on CUDA what torch allocated and reserved."""
    figures = {"process_rss_bytes": psutil.Process(os.getpid()).memory_info().rss}
    if device is not None and device.type == "cuda":
        figures["cuda_allocated_bytes"] = torch.cuda.memory_allocated(device)
        figures["cuda_reserved_bytes"] = torch.cuda.memory_reserved(device)
        figures["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        free, total = torch.cuda.mem_get_info(device)
        figures["cuda_free_bytes"], figures["cuda_total_bytes"] = free, total
    return figures


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a timing measures the computation and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def processor_name(device: torch.device) -> str:
    """The GPU's name on CUDA; on the CPU the model name the kernel reports (``/proc/cpuinfo``)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


# Vector widths and matrix units: other flags (virtualization, mitigations) differ between identical machines, missing the cache.
RELEVANT_CPU_FLAGS = ("avx", "amx", "fma", "f16c", "sse4", "asimd", "sve", "neon", "bf16", "fp16")


def cpu_flags(every: bool = False) -> list[str]:
    """The CPU's feature flags that a measured choice depends on (:data:`RELEVANT_CPU_FLAGS`), or ``every`` one, sorted."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return [platform.machine()]
    line = next((line for line in text.splitlines() if line.lower().startswith(("flags", "features"))), ":")
    return sorted({flag for flag in line.split(":", 1)[1].split() if every or flag.startswith(RELEVANT_CPU_FLAGS)})
