"""Sample CPU, memory and GPU use of the server and of the load generator while a level runs.

A background thread reads, every ``interval_s``, the cumulative CPU time and resident memory of each
watched process tree (psutil) and, where NVIDIA's management library is installed
(``nvidia-ml-py``), GPU utilisation and memory. :meth:`ResourceSampler.summary` then turns the
samples inside a time window into rates: CPU % = CPU seconds used / wall seconds, where 100 % is
one core fully busy (like ``top``).


On Linux it also reads how long the trees' threads were runnable but waiting for a CPU (the second
field of ``/proc/<pid>/task/<tid>/schedstat``): other work on the machine competing for the cores.
A load generator that waited a lot was starved, a server that waited a lot was slowed by others.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

try:  # optional: only machines with an NVIDIA GPU and nvidia-ml-py report GPU figures
    import pynvml
except ImportError:  # pragma: no cover - depends on the machine
    pynvml = None


@dataclass
class Sample:
    at: float  # wall clock, comparable with Locust's records
    cpu_s: dict[str, float]  # cumulative user+system CPU seconds per watched tree
    wait_s: dict[str, float | None]  # cumulative seconds runnable but not running (None: not Linux)
    rss_bytes: dict[str, int]
    gpu_util_percent: float | None
    gpu_memory_bytes: int | None


def run_queue_wait_s(pid: int) -> float | None:
    """Seconds the threads of ``pid`` spent runnable but waiting for a CPU, since they started (Linux only)."""
    total = 0.0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            total += int((task / "schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None
    return total


def tree_usage(root: psutil.Process) -> tuple[float, float | None, int] | None:
    """Cumulative CPU seconds, run-queue wait seconds and resident bytes of ``root`` and its descendants.

    Descendants count too (gunicorn's workers). Processes that vanish between listing and reading
    are skipped: a tree changes while we read it. ``None`` once the root itself is gone.
    """
    cpu_s, wait_s, rss = 0.0, 0.0, 0
    try:
        if root.status() == psutil.STATUS_ZOMBIE:
            return None
        members = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    for process in members:
        try:
            with process.oneshot():
                times = process.cpu_times()
                cpu_s += times.user + times.system
                rss += process.memory_info().rss
        except psutil.Error:
            continue
        wait = run_queue_wait_s(process.pid)
        wait_s = None if wait is None or wait_s is None else wait_s + wait
    return cpu_s, wait_s, rss


class GpuReader:
    """GPU utilisation (%) and memory in use (bytes) of every visible NVIDIA GPU, summed; inert without NVML."""

    def __init__(self) -> None:
        self.handles = []
        if pynvml is None:
            return
        try:
            pynvml.nvmlInit()
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except pynvml.NVMLError:
            self.handles = []

    def read(self) -> tuple[float | None, int | None]:
        if not self.handles:
            return None, None
        try:
            utils = [pynvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self.handles]
            memory = [pynvml.nvmlDeviceGetMemoryInfo(h).used for h in self.handles]
        except pynvml.NVMLError:
            return None, None
        return sum(utils) / len(utils), sum(memory)


class ResourceSampler:
    """Samples the named process trees in a background thread from ``start()`` to ``stop()``.

    ``trees`` maps a name (``server``, ``loadgen``) to the pid at the root of the tree.
    """

    def __init__(self, trees: dict[str, int], interval_s: float = 0.25) -> None:
        self.roots = {name: psutil.Process(pid) for name, pid in trees.items()}
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self._gpu = GpuReader()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="resource-sampler", daemon=True)

    def start(self) -> ResourceSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()
        self._take()  # one last sample, so a window that ends now has a right edge

    def _take(self) -> None:
        cpu, wait, rss = {}, {}, {}
        for name, root in self.roots.items():
            usage = tree_usage(root)
            if usage is not None:  # a finished tree has no figures, rather than zeros
                cpu[name], wait[name], rss[name] = usage
        gpu_util, gpu_memory = self._gpu.read()
        self.samples.append(Sample(time.time(), cpu, wait, rss, gpu_util, gpu_memory))

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._take()
            self._stopped.wait(self.interval_s)

    def summary(self, start: float, end: float) -> dict[str, float | None]:
        """Figures over the samples inside ``[start, end]`` (the level's window), in the result's field names."""
        inside = [s for s in self.samples if start <= s.at <= end]
        if len(inside) < 2:  # a window shorter than the interval: use the closest samples around it
            inside = self._around(start, end)
        if len(inside) < 2:
            return {}

        def percent_of_core(seconds: str, name: str) -> float | None:
            measured = [(s.at, getattr(s, seconds)[name]) for s in inside if getattr(s, seconds).get(name) is not None]
            if len(measured) < 2:
                return None  # not watched, not measurable here, or the tree ended
            (t0, before), (t1, after) = measured[0], measured[-1]
            if t1 <= t0 or after < before:
                return None  # a process of the tree ended mid-window and took its CPU time with it
            return 100.0 * (after - before) / (t1 - t0)

        server_rss = [s.rss_bytes["server"] for s in inside if "server" in s.rss_bytes]
        gpu_utils = [s.gpu_util_percent for s in inside if s.gpu_util_percent is not None]
        gpu_memory = [s.gpu_memory_bytes for s in inside if s.gpu_memory_bytes is not None]
        return {
            "loadgen_cpu_percent": percent_of_core("cpu_s", "loadgen"),
            "loadgen_cpu_wait_percent": percent_of_core("wait_s", "loadgen"),
            "server_cpu_percent": percent_of_core("cpu_s", "server"),
            "server_cpu_wait_percent": percent_of_core("wait_s", "server"),
            "server_rss_mb_max": max(server_rss) / 2**20 if server_rss else None,
            "server_rss_mb_mean": sum(server_rss) / len(server_rss) / 2**20 if server_rss else None,
            "gpu_util_percent_mean": sum(gpu_utils) / len(gpu_utils) if gpu_utils else None,
            "gpu_memory_mb_max": max(gpu_memory) / 2**20 if gpu_memory else None,
        }

    def _around(self, start: float, end: float) -> list[Sample]:
        before = [s for s in self.samples if s.at <= start][-1:]
        after = [s for s in self.samples if s.at >= end][:1]
        return before + after
