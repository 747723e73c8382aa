"""Describe the machine and the code a benchmark ran on, for the results' ``environment`` block."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import psutil
import torch

from benchmarks.harness.profiles import Profile
from benchmarks.harness.results import REPO_ROOT, Environment
from shared.devices import processor_name


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


RECORDED_RESULTS = "benchmarks/reference"  # results the harness writes: measured code is everything else


def git_state() -> tuple[str | None, bool | None]:
    """The commit and whether tracked or untracked (not ignored) files differ from it, results the
    harness itself saved under ``benchmarks/reference/`` aside (a climb, then an open loop, in a row)."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--", ".", f":(exclude){RECORDED_RESULTS}")
    return commit, (None if status is None else bool(status))


def cpu_model() -> str:
    """The CPU's model name (the same words the engine cache is keyed by)."""
    return processor_name(torch.device("cpu"))


def cpu_description() -> str:
    """The CPU's model name and the widest vector instructions torch uses on it (AVX2, AVX512, ...)."""
    return f"{cpu_model()}, {torch.backends.cpu.get_cpu_capability()}"


def _version(package: str) -> str | None:
    # importlib.metadata reads the installed version without importing the package (locust would patch us)
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def gpu_description(uses_gpu: bool = False) -> tuple[str | None, str | None]:
    """The first GPU's name and the CUDA version torch was built with, or ``(None, None)``.

    Torch (seconds to import) is only asked where the run uses a GPU or an NVIDIA driver is loaded.
    """
    if not uses_gpu and not Path("/proc/driver/nvidia").exists():
        return None, None
    try:
        import torch
    except ImportError:
        return None, None
    if not torch.cuda.is_available():
        return None, None
    return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}", torch.version.cuda


def collect_environment(profile: Profile, server_cores: list[int] | None, loadgen_cores: list[int] | None) -> Environment:
    commit, dirty = git_state()
    gpu, cuda = gpu_description(uses_gpu=any("cuda" in arg for arg in profile.model_args))
    return Environment(
        git_commit=commit,
        git_dirty=dirty,
        python=platform.python_version(),
        torch=_version("torch"),
        locust=_version("locust"),
        platform=platform.platform(),
        cpu_model=cpu_model(),
        logical_cores=os.cpu_count() or 1,
        physical_cores=psutil.cpu_count(logical=False),
        gpu=gpu,
        cuda=cuda,
        load_average_at_start=[round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        torch_threads=profile.torch_threads,
        thread_env=profile.server_env(),
        pinning=server_cores is not None,
        server_cores=server_cores,
        loadgen_cores=loadgen_cores,
    )
