"""README blocks of the studies (``benchmarks/studies/``): chapter 4's memory ledger, chapter 8's step
profiles, its event loop, sampling's cost, the live page's cost, and decode attention's candidates.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks.report.paths import current_command, repo_path


def kv_share_block(directory: Path) -> str:
    """Chapter 4's pool under load, before and after one ledger, from ``benchmarks.studies.kv_share.kv_share`` files (``<dir>/ch04/``)."""
    files = sorted((directory / "ch04").glob("kv-share-*.json")) if (directory / "ch04").exists() else []
    if not files:
        return f"*No measurement yet: `python -m benchmarks.studies.kv_share.kv_share --url ... --out {repo_path(directory)}/ch04/kv-share-LABEL.json`.*"
    lines = ["| run | how memory is reserved | users | share of the pool reserved (mean) | share of the reserved slots written | answered |",
             "|---|---|---|---|---|---|"]
    for path in files:
        run = json.loads(path.read_text())
        share = "—" if run["written_share_mean"] is None else f"{run['written_share_mean']:.0%}"
        lines.append(f"| {run['label']} | {run['layout']} | {run['users']} | {run['reserved_share_mean']:.0%} | {share} | {run['answered']} |")
    return "\n".join(lines) + ("\n\nReproduce: `bash benchmarks/studies/kv_share/kv_share.sh` (the commit before one ledger, then this one; loopback "
                                     "only; the script pins the server to core 0 with one torch thread and its client to core 1).")


def packed_step_profile_block(directory: Path) -> str:
    """Chapter 8's step in-process, from ``benchmarks.studies.ch08_step_profile.profile_ch08`` outputs (``<dir>/ch08/profile-*.txt``).

    A profile's first line names its attention, engine, KV cache, workload and block size; a file without
    that line (``profile-before.txt``) is a cProfile run whose only figure is its rate. The CPU cell reads
    ``not recorded`` for a profile without a ``CPU:`` line."""
    files = sorted((directory / "ch08").glob("profile-*.txt")) if (directory / "ch08").exists() else []
    if not files:
        return f"*No profile yet: `python -m benchmarks.studies.ch08_step_profile.profile_ch08 > {repo_path(directory)}/ch08/profile-LABEL.txt`.*"
    lines = ["| file | attention | engine | KV cache | block (tokens) | workload | requests/s | median step (ms) | model share "
             "| schedule + prepare + update | CPU |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for path in files:
        text = path.read_text()
        rate = re.search(r"= ([\d.]+) req/s(.*)", text)
        head = re.search(r"attention (\S+), engine (\S+), KV cache (\S+), workload (\S+), blocks of (\d+),", text.splitlines()[0])
        step = re.search(r"median step ([\d.]+) ms: .*model [\d.]+ ms \((\d+)%\)", text)
        overhead = re.search(r"schedule \+ prepare \+ update = ([\d.]+%)", text)
        cpu = re.search(r"^CPU: (.*)$", text, re.MULTILINE)
        cpu_cell = cpu.group(1) if cpu else "not recorded"
        if head is None:  # cProfile's figure only
            lines.append(f"| `{path.name}` | (before: two or more padded calls a step) | eager/fp32 | float32 | 16 | default "
                         f"| {rate.group(1)}{' (under cProfile)' if 'cProfile' in rate.group(2) else ''} | — | — | — | {cpu_cell} |")
            continue
        lines.append(f"| `{path.name}` | {head.group(1)} | {head.group(2)} | {head.group(3)} | {head.group(5)} "
                     f"| {head.group(4)} | {rate.group(1)} "
                     f"| {step.group(1)} | {step.group(2)} % | {overhead.group(1)} | {cpu_cell} |")
    return "\n".join(lines) + (
        "\n\nReproduce: `python -m benchmarks.studies.ch08_step_profile.profile_ch08 --attention A --precision P --kv-cache-dtype K --workload W "
        "--block-tokens B` (each file's first "
        "lines; the rest is cProfile's report of the same steps, sorted by internal time). The `before` file's first line "
        "names its command: the profiler of the commit before the packed step, whose figure is taken under cProfile "
        "(so it ran somewhat faster than it reads). One process, no client and no server: nothing to pin.")


def event_loop_block(folder: Path) -> str:
    """Chapter 8's event loop beside its step thread, per source tree, from the ``.json`` files of the
    study's folder (``benchmarks/studies/event_loop/``, ``thread_share.py`` there): the median of the
    rounds per tree. The loop's share spent in the kernel reads ``—`` for a run that did not split it."""
    files = sorted(folder.glob("*.json")) if folder.exists() else []
    if not files:
        return f"*No rounds yet: `python {repo_path(folder)}/thread_share.py --trees BASE . --out {repo_path(folder)}/NAME.json`.*"
    lines = ["| workload | answers | users | rounds | tree | QPS | P99 (ms) | event loop: share of the server's CPU | of it in the kernel "
             "| event loop per request (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    commands, machines = [], set()
    for path in files:
        run = json.loads(path.read_text())
        for tree in run["trees"]:
            median = tree["median"]
            answers = "streamed" if tree["streamed"] else "whole"
            flags = f" `{tree['server_args']}`" if tree["server_args"] else ""
            kernel = median.get("event_loop_kernel_share")
            lines.append(f"| {run['workload']} | {answers} | {run['users']} | {run['rounds']} | {tree['label']} (`{tree['commit']}`){flags} "
                         f"| {median['qps']:.1f} | {median['p99_ms']:,.0f} | {median['event_loop_share']:.1%} "
                         f"| {'—' if kernel is None else f'{kernel:.1%}'} | {median['event_loop_ms_per_request']:.2f} |")
        commands.append(f"`{current_command(run['command'])}`")
        machines.add(run["cpu"])
    return ("\n".join(lines) + "\n\nThe median of the rounds per tree; the trees alternate within each round. CPU: "
            + ", ".join(sorted(machines)) + "; the climb's `cpu` profile settings, server pinned to one core, the client on the "
            "other. Reproduce (each tree a checkout of its commit): " + "; ".join(commands) + ".")


def sampling_block(directory: Path) -> str:
    """Chapter 8's step greedy against sampled, from ``benchmarks.studies.ch08_step_profile.profile_ch08 --sampling-rounds`` (``<dir>/ch08/sampling.json``)."""
    path = directory / "ch08" / "sampling.json"
    if not path.exists():
        return (f"*No sampling measurement yet: `python -m benchmarks.studies.ch08_step_profile.profile_ch08 --sampling-rounds 5 --out "
                f"{repo_path(path)}` records one.*")
    run = json.loads(path.read_text())
    lines = ["| round | greedy (req/s) | sampled (req/s) | sampled / greedy | update phase, greedy / sampled (median ms) |",
             "|---|---|---|---|---|"]
    for index, row in enumerate(run["rounds"], 1):
        greedy, sampled = row["greedy"], row["sampled"]
        lines.append(f"| {index} ({' first, '.join(row['order'])} second) | {greedy['requests_per_s']:.1f} | {sampled['requests_per_s']:.1f} "
                     f"| {sampled['requests_per_s'] / greedy['requests_per_s']:.2f}× "
                     f"| {greedy['median_update_ms']:.2f} / {sampled['median_update_ms']:.2f} |")
    return ("\n".join(lines) + f"\n\nMedian ratio over the rounds: **{run['median_ratio']:.2f}×**. In-process, no HTTP: "
            f"{run['steps']} steps of the loop per run, {run['greedy']} against {run['sampled'].rsplit(', ', 1)[-1]}. "
            f"Reproduce: `{current_command(run['command'])}`.")


def live_page_cost_block(directory: Path, chapter: str) -> str:
    """A chapter's throughput with the live page's stream open and without (``benchmarks.studies.live_page_cost.live_page_cost``,
    ``<dir>/<chapter>/live-page-cost.json``): every round, the same server both ways."""
    from benchmarks.harness.streaming import describe_harness

    path = directory / chapter / "live-page-cost.json"
    if not path.exists():
        return (f"*No measurement of the page's cost yet: `python -m benchmarks.studies.live_page_cost.live_page_cost --profile cpu --chapter {chapter} "
                f"--out {repo_path(path)}` records one.*")
    run = json.loads(path.read_text())
    lines = ["| round | unwatched (req/s) | watched (req/s) | watched / unwatched | server CPU per request, watched / unwatched "
             "| events a viewer got | dropped for it |",
             "|---|---|---|---|---|---|---|"]
    for index, row in enumerate(run["rounds"], 1):
        viewers = row["watched"].get("viewers", [])
        events = sum(sum(v["events"].values()) for v in viewers)
        dropped = sum(v["dropped_total"] for v in viewers)
        lines.append(f"| {index} ({row['order'][0]} first) | {row['unwatched']['qps']:.1f} | {row['watched']['qps']:.1f} "
                     f"| {row['ratio']:.3f}× | {row['cpu_per_request_ratio']:.3f}× | {events:,} | {dropped:,} |")
    return ("\n".join(lines) + f"\n\nMedians over the rounds: throughput **{run['median_ratio']:.3f}×**, the server's CPU time "
            f"per answered request **{run['median_cpu_per_request_ratio']:.3f}×** ({run['users']} users, "
            f"`{run['workload']}` workload, {run['duration_s']:.0f} s per run, {run['viewers']} viewer(s) reading every event; "
            f"{describe_harness(run['harness'])}). Reproduce: `{current_command(run['command'])}`." + _event_cost_sentence(directory / chapter))


def _event_cost_sentence(folder: Path) -> str:
    """Chapter 8's step and event side by side in-process (``live_page_cost --in-process``), where measured."""
    path = folder / "live-page-event-cost.json"
    if not path.exists():
        return ""
    run = json.loads(path.read_text())
    return (f"\n\nWithout HTTP and its noise, the step thread's own step and event side by side ({run['running']} sequences "
            f"decoding, CPU time, medians of {run['samples']}): a step {run['median_step_cpu_ms']:.1f} ms, building and "
            f"serializing its event {run['median_event_cpu_ms']:.2f} ms ({run['median_event_bytes'] / 1024:.1f} KiB), "
            f"{run['event_per_step_ratio']:.1%} of the step; at most {run['max_events_per_s']:.0f} events a second, that "
            f"is **{run['cost_share_at_cap']:.1%}** of the server's time. Reproduce: `{current_command(run['command'])}`.")


def decode_attention_block(directory: Path, folder: str = "") -> str:
    """One layer's decode attention, every candidate side by side (``benchmarks.studies.decode_attention.decode_attention``,
    ``<dir>/ch08/decode-attention-<workload>.json``, or every JSON file of ``<dir>/ch08/<folder>/``: another
    machine's), and the rest of the step eager against compiled (where the run measured it: ``step_without_attention``
    not ``None``)."""
    where = directory / "ch08" / folder
    files = sorted(where.glob("*.json" if folder else "decode-attention-*.json")) if where.exists() else []
    if not files:
        name = f"{folder}/mixed.json" if folder else "decode-attention-default.json"
        return (f"*No measurement yet: `python -m benchmarks.studies.decode_attention.decode_attention --workload default --out "
                f"{repo_path(directory)}/ch08/{name}` records one.*")
    runs = sorted((json.loads(path.read_text()) for path in files),
                  key=lambda run: (run["workload"], run["attention"]["block_tokens"]))
    names = list(runs[0]["attention"]["per_layer"])
    lines = ["| workload | rows | block (tokens) | context median / max | bytes read (MB) | " + " | ".join(names) + " |",
             "|---|---|---|---|---|" + "---|" * len(names)]
    for run in runs:
        part = run["attention"]
        cells = [f"{part['per_layer'][n]['min_ms']:.2f} ({part['gb_per_s_at_min'][n]:.1f} GB/s)" for n in names]
        lines.append(f"| {run['workload']} | {part['rows']} | {part['block_tokens']} | {part['context_median']:.0f} / {part['context_max']} "
                     f"| {part['bytes_read_mb']:.1f} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + (
        "\n\nMilliseconds per layer, the fastest of each candidate's interleaved rounds (the bytes a step must read "
        "divided by that time in brackets; `dense cache` reads its padding too).")
    for run in runs:
        part = run["attention"]
        dense, flex, own = (part["per_layer"][name] for name in ("dense cache", "flex kernel", "kernel call"))
        rate = part["dense_cache_bytes_mb"] / dense["min_ms"]  # MB per ms = GB/s
        at_rate = part["bytes_read_mb"] / rate
        text += (f"\n\n`{run['workload']}`, blocks of {part['block_tokens']}: SDPA reads the contiguous cache, padding "
                 f"included ({part['dense_cache_bytes_mb']:.1f} MB), at {rate:.1f} GB/s; at that rate the step's own "
                 f"{part['bytes_read_mb']:.1f} MB would take {at_rate:.2f} ms, against {flex['min_ms']:.2f} ms for "
                 f"`flex kernel`: at most **{flex['min_ms'] / at_rate:.1f}×** to gain on this layer's decode attention."
                 f" This chapter's own kernel, its writes of the step's keys and values included, took "
                 f"{own['min_ms']:.2f} ms: **{flex['min_ms'] / own['min_ms']:.1f}×** faster than `flex kernel`.")
    steps = [(run["workload"], run["step_without_attention"]) for run in runs if run["step_without_attention"] is not None]
    if steps:
        rows = ["| workload | tokens | eager (ms) | compiled (ms) | compiled / eager |", "|---|---|---|---|---|"]
        for workload, part in steps:
            for tokens, timing in part.items():
                eager, compiled = timing["eager"]["min_ms"], timing["compiled"]["min_ms"]
                rows.append(f"| {workload} | {tokens} | {eager:.2f} | {compiled:.2f} | {compiled / eager:.2f}× |")
        text += ("\n\nThe rest of the packed step (every layer without its attention, and the output layer), eager "
                 "and under `torch.compile` with dynamic token counts:\n\n" + "\n".join(rows))
    first = runs[0]
    return text + (f"\n\nOne torch thread, engine {first['attention']['engine']}, KV cache {first['attention']['kv_cache_dtype']}, "
                   f"{first['rounds']} rounds, torch {first['torch']}, {first['cpu']}. Reproduce: "
                   + "; ".join(f"`{current_command(run['command'])}`" for run in runs) + ".")


def study_file_block(path: Path) -> str:
    """A study's results as its command wrote them (a text file beside its script), verbatim: a study
    that prints its answer keeps the printout, and its README shows it from the file, never retyped."""
    if not path.exists():
        return f"*No results yet: the study's command (above) writes `{repo_path(path)}`.*"
    return f"```\n{path.read_text().rstrip()}\n```\n\nAs committed in `{repo_path(path)}`."
