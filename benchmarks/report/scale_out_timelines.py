"""Reading a chapter 9 timeline file (the failure drill's, the autoscaling step's): answers per window,
Serve's replica count over time, figures per step of the load, and each new replica's start-up.

The files are written by the study ``benchmarks/studies/scale_out_timeline/``; the README blocks
(:mod:`benchmarks.report.scale_out_blocks`) and chapter 9's notebook read them through these.
"""

from __future__ import annotations


def per_window(requests: list[dict], width_s: float = 1.0) -> list[dict]:
    """Answers per second and the P99 of their latency (whole answer, ms), in windows by end time.

    Only answered requests (``ok``, ``replayed``) count: a window's QPS is the capacity it showed."""
    done = [r for r in requests if r["outcome"] in ("ok", "replayed")]
    if not done:
        return []
    first = min(r["end_s"] for r in done)
    buckets: dict[int, list[float]] = {}
    for r in done:
        buckets.setdefault(int((r["end_s"] - first) // width_s), []).append((r["end_s"] - r["start_s"]) * 1000)
    windows = []
    for index in range(max(buckets) + 1):
        latencies = sorted(buckets.get(index, []))
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else None
        windows.append({"t_s": round(first + index * width_s, 3), "qps": len(latencies) / width_s, "p99_ms": p99})
    return windows


def replica_changes(polls: list[dict]) -> list[tuple[float, int]]:
    """(time, running replicas) at every change of Serve's count, starting with the first poll."""
    changes: list[tuple[float, int]] = []
    for poll in polls:
        if poll["running"] is not None and (not changes or changes[-1][1] != poll["running"]):
            changes.append((poll["t_s"], poll["running"]))
    return changes


def step_figures(timeline: dict) -> list[dict]:
    """Per step of the load: its clients, answers per second, P99 (ms) and the most replicas running."""
    out, start = [], 0.0
    for seconds, clients in timeline["steps"]:
        end = start + seconds
        done = sorted((r["end_s"] - r["start_s"]) * 1000 for r in timeline["requests"]
                      if r["outcome"] in ("ok", "replayed") and start <= r["end_s"] < end)
        running = [p["running"] for p in timeline["polls"] if start <= p["t_s"] < end and p["running"] is not None]
        out.append({"from_s": start, "to_s": end, "clients": clients, "qps": len(done) / seconds,
                    "p99_ms": done[min(len(done) - 1, int(0.99 * len(done)))] if done else None,
                    "replicas_max": max(running, default=None), "replicas_at_end": running[-1] if running else None})
        start = end
    return out


def startup_split(timeline: dict) -> list[dict]:
    """For each replica started during the load: when its process started, its first and last log lines
    before it served (times as in the timeline), and when Serve first counted one more replica running."""
    out = []
    for pid, startup in timeline.get("replica_startups", {}).items():
        log = startup.get("log", [])
        serving = next((line for line in log if "Application startup complete" in line["message"]
                        or "serving" in line["message"]), None)
        out.append({"pid": pid, "process_started_s": startup["process_started_s"],
                    "first_log_s": log[0]["t_s"] if log else None, "first_log": log[0]["message"] if log else None,
                    "app_ready_s": serving["t_s"] if serving else None})
    return out
