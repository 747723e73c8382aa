"""README blocks of chapter 9: the failure drill, autoscaling under a step load, replicas and routers,
the load generator's ceilings, and the simulation of many replicas.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks.report.paths import current_command, repo_path


SCALE_OUT_DIR = "ch09"
DRILL_FILES = {"failure-drill.json": "fast start (engine, precision and attention pinned; gather: nothing compiled), no spare",
               "failure-drill-chapter-defaults.json": "chapter 8's defaults (engine and attention measured at start, flex compiled), no spare",
               **{f"failure-drill-spare-{k}.json": f"chapter 8's and 9's defaults: one warm spare (`--spare-replicas 1`), run {k}"
                  for k in (1, 2, 3)},
               "failure-drill-smollm2.json": "the real model (`--weights=smollm2 --precision=bf16`), one warm spare"}


def drill_block(directory: Path) -> str:
    """Chapter 9's failure drill (``benchmarks.studies.scale_out_timeline.scale_out_timeline drill``): the ledger and the replacement's start-up."""
    from benchmarks.report.scale_out_timelines import startup_split

    folder = directory / SCALE_OUT_DIR
    runs = [(name, how, json.loads((folder / name).read_text())) for name, how in DRILL_FILES.items() if (folder / name).exists()]
    if not runs:
        return f"*No drill yet: `python -m benchmarks.studies.scale_out_timeline.scale_out_timeline drill --out {repo_path(folder)}/failure-drill.json`.*"

    def s(value) -> str:
        return "never" if value is None else f"{value:.1f}"

    lines = ["| replicas start with | requests | answered at once | replayed, then answered | contract error | broken | in flight at the kill "
             "| touched outside the kill | replacement's process (s) | its first log line (s) | its app ready (s) "
             "| replicas the load needs running again (s) | every replica running again (s) | answers/s, 5 s before / after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    commands = []
    for _name, how, run in runs:
        ledger = run["accounting"]
        split = startup_split(run)
        first = split[0] if split else {}
        lines.append(f"| {how} | {ledger['requests']} | {ledger['ok']} | {ledger['replayed']} | {ledger['contract_error']} "
                     f"| {ledger['broken']} | {ledger['in_flight_at_kill']} | {ledger['touched_outside_kill']} "
                     f"| {s(first.get('process_started_s'))} | {s(first.get('first_log_s'))} | {s(first.get('app_ready_s'))} "
                     f"| {s(ledger['capacity_back_s'])} | {s(ledger['replacement_ready_s'])} "
                     f"| {_before_after(ledger)} |")
        commands.append(f"`{current_command(run['command'])}`")
    run = runs[0][2]
    return ("\n".join(lines) + f"\n\nTimes in seconds from the SIGKILL of one of {run['server_args'][1]} replicas, under "
            f"{run['steps'][0][1]} closed-loop clients (every other request a stream of {run['max_new_tokens']} tokens); "
            f"{run['cpu_count']} cores shared by the replicas, Serve, Ray and the clients. Reproduce: " + "; ".join(commands) + ".")


def _before_after(ledger: dict) -> str:
    """Answers per second in the 5 s before and after the kill; ``—`` for a ledger without those counts."""
    if "answers_per_s_before" not in ledger:
        return "—"
    return f"{ledger['answers_per_s_before']:.1f} / {ledger['answers_per_s_after']:.1f}"


def autoscale_block(directory: Path) -> str:
    """Chapter 9's autoscaling under a step load (``benchmarks.studies.scale_out_timeline.scale_out_timeline autoscale``): per step."""
    from benchmarks.report.scale_out_timelines import replica_changes, startup_split, step_figures

    path = directory / SCALE_OUT_DIR / "autoscale-timeline.json"
    if not path.exists():
        return f"*No autoscaling timeline yet: `python -m benchmarks.studies.scale_out_timeline.scale_out_timeline autoscale --out {repo_path(path)}`.*"
    run = json.loads(path.read_text())
    lines = ["| seconds | clients | answers/s | P99 (ms) | most replicas running | at the step's end |", "|---|---|---|---|---|---|"]
    for step in step_figures(run):
        p99 = "—" if step["p99_ms"] is None else f"{step['p99_ms']:,.0f}"
        lines.append(f"| {step['from_s']:.0f}-{step['to_s']:.0f} | {step['clients']} | {step['qps']:.1f} | {p99} "
                     f"| {step['replicas_max']} | {step['replicas_at_end']} |")
    changes = ", ".join(f"{count} at {t:.1f} s" for t, count in replica_changes(run["polls"]))
    starts = ", ".join(f"a process at {x['process_started_s']:.1f} s, its app ready at "
                       f"{'—' if x['app_ready_s'] is None else format(x['app_ready_s'], '.1f')} s" for x in startup_split(run))
    ledger = run["accounting"]
    return ("\n".join(lines) + f"\n\nReplicas running (Serve's count): {changes}. New replicas: {starts or 'none'}. "
            f"{ledger['requests']} requests, {ledger['broken']} broken, {ledger['contract_error']} contract errors. "
            f"Reproduce: `{current_command(run['command'])}` (replica flags: `{' '.join(run['server_args'])}`).")


def replicas_block(directory: Path, name: str = "replicas-and-routers.json", against: str | None = "1 replica") -> str:
    """Chapter 8 alone, one replica, two under each router (``benchmarks.studies.replicas_and_routers.scale_out_compare``):
    medians of the rounds, each against the configuration ``against`` (None: the file's first). ``name``: the file
    under ``<dir>/ch09/``."""
    path = directory / SCALE_OUT_DIR / name
    if not path.exists():
        return f"*No comparison yet: `python -m benchmarks.studies.replicas_and_routers.scale_out_compare --out {repo_path(path)}`.*"
    run = json.loads(path.read_text())
    against = against or next(iter(run["configs"]))
    base = run["configs"].get(against, {}).get("median", {})
    lines = [f"| configuration | QPS | against {against} | tokens/s | TTFT P50 / P99 (ms) | E2E P50 / P99 (ms) "
             "| cores busy: the client; the server's processes |", "|---|---|---|---|---|---|---|"]
    for label, config in run["configs"].items():
        m = config["median"]
        ratio = f"{m['qps'] / base['qps']:.2f}×" if base.get("qps") else "—"
        server = "; ".join(f"{group} {cores:.2f}" for group, cores in sorted(m["server_cores_busy"].items(), key=lambda kv: -kv[1]))
        lines.append(f"| {label} | {m['qps']:.1f} | {ratio} | {m['output_tokens_per_s']:,.0f} | {m['ttft_ms_p50']:,.0f} / "
                     f"{m['ttft_ms_p99']:,.0f} | {m['e2e_ms_p50']:,.0f} / {m['e2e_ms_p99']:,.0f} "
                     f"| client {m['client_cores_busy']:.2f}; {server or '—'} |")
    return ("\n".join(lines) + f"\n\nMedians of {run['rounds']} rounds (configurations alternating), `{run['workload']}` "
            f"workload, {run['users']} closed-loop streaming users for {run['duration_s']:g} s each; every server with "
            f"`{run['server_args']}`; server and client share this machine's cores, unpinned. Reproduce: `{current_command(run['command'])}`.")


# the processes where an answer's CPU goes, grouped as scale_out_compare.cpu_by_group names them
APP_GROUPS = ("server", "replicas")  # chapter 8 alone's process, or the replica
OTHER_GROUPS = ("Serve's controller", "Ray's other processes")  # besides the proxy
SERVE_PATH_CONFIGS = ("chapter 8 alone", "1 replica", "1 replica, direct ingress", "chapter 8 alone, runs of 64", "1 replica, runs of 64")


def serve_path_command(workload: str, out: str) -> str:
    """The command that records the serve-path comparison on ``workload`` into ``out``."""
    configs = " ".join(f"'{label}'" for label in SERVE_PATH_CONFIGS)
    return (f"python -m benchmarks.studies.replicas_and_routers.scale_out_compare --configs {configs} --workload {workload} "
            f"--duration-s 15 --rounds 3 --out {out}")


def answer_costs(run: dict) -> list[dict]:
    """Per configuration of a serve-path comparison: tokens per answer and core-milliseconds per answer by where they
    went (``app``: chapter 8 alone's server or the replica; ``proxy``; ``others``: Serve's controller and Ray's other
    processes), their ``total``, and ``against`` chapter 8 alone written in the same runs (None where there is none)."""
    out, alone = [], {}  # alone: "runs of N" (or "": every token a write) -> chapter 8 alone's total
    for label, config in run["configs"].items():
        m = config["median"]
        per_answer = {group: 1000 * cores / m["qps"] for group, cores in m["server_cores_busy"].items()}
        runs = match[0] if (match := re.search(r"runs of \d+", label)) else ""
        total = sum(per_answer.values())
        if label.startswith("chapter 8 alone"):
            alone[runs] = total
        out.append({"label": label, "tokens": m["output_tokens_per_s"] / m["qps"],
                    "app": sum(per_answer.get(group, 0.0) for group in APP_GROUPS), "proxy": per_answer.get("Serve's proxy", 0.0),
                    "others": sum(per_answer.get(group, 0.0) for group in OTHER_GROUPS), "total": total,
                    "against": total / alone[runs] if alone.get(runs) else None})
    return out


def serve_path_cost_block(directory: Path, workload: str) -> str:
    """What an answer costs in CPU on each side of Serve's path (``serve-path-<workload>.json``): each configuration's
    cores busy over its answers per second, as core-milliseconds per answer, by where they were spent."""
    path = directory / SCALE_OUT_DIR / f"serve-path-{workload}.json"
    if not path.exists():
        return f"*No comparison yet: `{serve_path_command(workload, repo_path(path))}`.*"
    lines = ["| configuration | tokens per answer | core-ms per answer: the app's process | Serve's proxy | Serve's and Ray's others "
             "| the server, all | against chapter 8 alone at the same runs |", "|---|---|---|---|---|---|---|"]
    for cost in answer_costs(json.loads(path.read_text())):
        against = "—" if cost["against"] is None else f"{cost['against']:.2f}×"
        lines.append(f"| {cost['label']} | {cost['tokens']:.0f} | {cost['app']:.1f} | {cost['proxy']:.1f} | {cost['others']:.1f} "
                     f"| {cost['total']:.1f} | {against} |")
    return ("\n".join(lines) + f"\n\nFrom the table above (`{repo_path(path)}`): each configuration's median cores busy divided by "
            "its median answers per second. The app's process is chapter 8's server alone, or the replica behind Serve; "
            "Serve's and Ray's others include Ray's bundled HAProxy where it runs (direct ingress); the client's own CPU is left out.")


def ceilings_block(directory: Path) -> str:
    """The harness's ceiling with one Locust process and in distributed mode (``<dir>/ch09/ceiling/``), side by side."""
    from benchmarks.report.tables import load_ceilings, loadgen_cores_of, loadgen_workers_of

    folder = directory / SCALE_OUT_DIR / "ceiling"
    ceilings = load_ceilings(folder) if folder.exists() else {}
    if not ceilings:
        return (f"*No ceilings yet: `python -m benchmarks ceiling --profile cpu --workers N --out {repo_path(folder)}` "
                "for N = 0, 1, 2.*")
    lines = ["| load generator | cores it had | best QPS | at users | its CPU (% of one core, all processes) |", "|---|---|---|---|---|"]
    commands = []
    for ceiling in sorted(ceilings.values(), key=loadgen_workers_of):
        top, workers = ceiling.saturation(), loadgen_workers_of(ceiling)
        how = "one Locust process" if workers == 0 else f"a master and {workers} worker{'s' if workers > 1 else ''}"
        cpu = "—" if top.loadgen_cpu_percent is None else f"{top.loadgen_cpu_percent:.0f}"
        lines.append(f"| {how} | {loadgen_cores_of(ceiling)} | {top.qps:,.0f} | {top.users} | {cpu} |")
        commands.append(f"`{ceiling.config.reproduce} --out {repo_path(folder)}`")
    return ("\n".join(lines) + "\n\nLocust against an instant endpoint (`benchmarks/harness/trivial_server.py`) on loopback, the "
            "`cpu` profile's core plan. Reproduce: " + "; ".join(commands) + ".")


SIMULATION_REPLICAS = (1, 2, 8, 64)


def simulation_block(directory: Path) -> str:
    """Chapter 9's simulation (``benchmarks.studies.scale_out_simulation.sweep``): P99s and goodput by router and replicas
    on ``mixed`` near and past the knee, what it assumes, and how one simulated replica compares with chapter 8."""
    path = directory / SCALE_OUT_DIR / "simulation.json"
    if not path.exists():
        return f"*No simulation yet: `python -m benchmarks.studies.scale_out_simulation.sweep --out {repo_path(path)}`.*"
    run = json.loads(path.read_text())
    points = {(p["mix"], p["router"], p["replicas"], p["utilisation"]): p for p in run["points"]}
    routers = run["settings"]["routers"]
    lines = ["| load | replicas | " + " | ".join(f"{r}: P99 / TTFT P99 (ms), in SLO" for r in routers) + " |",
             "|---|---|" + "---|" * len(routers)]
    for utilisation in (0.85, 0.95):
        for replicas in SIMULATION_REPLICAS:
            cells = []
            for router in routers:
                point = points.get(("mixed", router, replicas, utilisation))
                cells.append("—" if point is None else f"{point['latency_ms']['p99']:,.0f} / {point['ttft_ms']['p99']:,.0f}, "
                                                        f"{point['goodput_share']:.0%}")
            lines.append(f"| {utilisation:.0%} | {replicas} | " + " | ".join(cells) + " |")
    capacity = run["mixes"]["mixed"]["capacity_rps_per_replica"]
    slo = run["settings"]["slo"]
    levels = run["validation"]["one_replica_vs_open_loop"]["levels"]
    check = "; ".join(f"{lvl['offered_rps']:g}/s: {lvl['simulated']['p50_ms']:,.0f} simulated, {lvl['measured']['p50_ms']:,.0f} measured"
                      for lvl in levels if lvl.get("measured") and lvl.get("simulated"))
    assumptions = "\n".join(f"- {a}" for a in run["assumptions"])
    return ("\n".join(lines) + f"\n\nThe `mixed` workload; load is a share of what the replicas serve with full batches "
            f"({capacity:.1f} requests/s per simulated replica); P99 is of the whole answer, TTFT of the first token; "
            f"\"in SLO\" is the share of requests with TTFT within {slo['ttft_ms']:,.0f} ms and time per later token within "
            f"{slo['tpot_ms']:,.0f} ms. The file holds every point (1 to 64 replicas, 50 to 95 % load, three mixes). "
            f"Reproduce: `{current_command(run['command'])}`.\n\nOne simulated replica against chapter 8's measured open loop "
            f"(`default` workload, median ms): {check}.\n\nWhat the simulation assumes (from the file):\n\n{assumptions}")
