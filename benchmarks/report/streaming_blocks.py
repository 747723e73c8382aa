"""README blocks of servers compared by the streaming client (``python -m benchmarks.harness.streaming
compare``): chapter 6 against chapter 8, prefix caching on and off, the stream interval, chapter 7
against chapter 8 as deployed, and where chapter 8's targets stand. One JSON file per round; a table
reads the median of the rounds.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks.harness.results import load_results
from benchmarks.harness.workload import WORKLOADS
from benchmarks.report.paths import current_command, repo_path
from benchmarks.report.tables import measured_row


def streaming_block(directory: Path) -> str:
    """Chapter 6 against chapter 8 from ``benchmarks.harness.streaming compare`` files (``<dir>/streaming/<workload>.json``)."""
    def ms(figures: dict | None, key: str) -> str:
        value = (figures or {}).get(key)
        return "—" if value is None else f"{value:,.0f}"

    lines = ["| workload | chapter | users | QPS | tokens/s | TTFT P50 / P99 (ms) | TPOT P50 (ms) | total P50 / P99 (ms) | errors |",
             "|---|---|---|---|---|---|---|---|---|"]
    from benchmarks.harness.streaming import describe_harness

    files = sorted((directory / "streaming").glob("*.json")) if (directory / "streaming").exists() else []
    commands, settings = [], set()
    for path in files:
        run = json.loads(path.read_text())
        commands.append(f"`{current_command(run['command'])}`")
        settings.add(describe_harness(run["harness"]) + (f", every server with `{run['server_args']}`" if run["server_args"] else ""))
        for chapter, figures in run["chapters"].items():
            errors = sum(figures["errors"].values())
            lines.append(
                f"| {run['workload']} | {chapter} | {run['users']} | {figures['qps']:.1f} | {figures['output_tokens_per_s']:,.0f} "
                f"| {ms(figures['ttft_ms'], 'p50')} / {ms(figures['ttft_ms'], 'p99')} | {ms(figures['tpot_ms'], 'p50')} "
                f"| {ms(figures['e2e_ms'], 'p50')} / {ms(figures['e2e_ms'], 'p99')} | {errors} |")
    if not files:
        return ("*No streaming comparison yet: `python -m benchmarks.harness.streaming compare --chapters ch06 ch08 --workload mixed "
                f"--out {repo_path(directory)}/streaming/mixed.json` records one.*")
    return "\n".join(lines) + "\n\nReproduce: " + "; ".join(commands) + (
        ". How the servers ran: " + "; ".join(sorted(settings)) + ". This client (not Locust) sends the requests "
        "and reads the streams. A non-streamed answer's first token arrives with its last, so chapter 6's TTFT is its total time.")


def prefix_caching_block(directory: Path) -> str:
    """Chapter 8 with prefix caching on and off (``benchmarks.harness.streaming compare`` with the two variants of
    :data:`benchmarks.harness.streaming.PREFIX_CACHING_VARIANTS`, ``<dir>/ch08/prefix-caching/<workload>.json``): a table
    per workload, ``shared-prefix`` first, each variant's figures and on's over off's."""
    from benchmarks.harness.streaming import (
        PREFIX_CACHING_DIR,
        PREFIX_CACHING_VARIANTS,
        PREFIX_CACHING_WORKLOADS,
        describe_harness,
        prefix_caching_command,
    )

    folder = directory / PREFIX_CACHING_DIR
    found = {path.stem: path for path in sorted(folder.glob("*.json"))} if folder.exists() else {}
    results_dir = repo_path(directory)
    if not found:
        return (f"*No prefix-caching comparison yet: `{prefix_caching_command('shared-prefix', results_dir)}` records one "
                "(then the same with `--workload default` and `--workload mixed`, each to its own file).*")
    on, off = PREFIX_CACHING_VARIANTS

    def figure(figures: dict | None, *path: str) -> float | None:
        value: object = figures
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return value if isinstance(value, (int, float)) else None

    def ms(value: float | None) -> str:
        return "—" if value is None else f"{value:,.0f}"

    def ratio(a: float | None, b: float | None) -> str:
        return "—" if a is None or not b else f"{a / b:.2f}×"

    order = [w for w in PREFIX_CACHING_WORKLOADS if w in found] + sorted(set(found) - set(PREFIX_CACHING_WORKLOADS))
    parts, commands, settings = [], [], set()
    for workload in order:
        run = json.loads(found[workload].read_text())
        commands.append(f"`{current_command(run['command'])}`")
        settings.add(describe_harness(run["harness"]) + (f", every server with `{run['server_args']}`" if run["server_args"] else ""))
        rounds = run["rounds"]
        how = f"median-QPS round of {rounds}" if rounds > 1 else "one round"
        lines = [f"**`{run['workload']}`**, {run['users']} streaming users for {run['duration_s']:g} s, {how}:", "",
                 "| prefix caching | QPS | TTFT P50 / P99 (ms) | TPOT P50 (ms) | errors | prompt tokens found cached |",
                 "|---|---|---|---|---|---|"]
        side = {label: run["chapters"].get(label) for label in (on, off)}
        for label, figures in side.items():
            if figures is None:
                lines.append(f"| {label.removeprefix('caching-')} | not measured | | | | |")
                continue
            hit_rate = figure(figures, "prefix_cache", "hit_rate")
            lines.append(f"| {label.removeprefix('caching-')} | {figures['qps']:.1f} | {ms(figure(figures, 'ttft_ms', 'p50'))} / "
                         f"{ms(figure(figures, 'ttft_ms', 'p99'))} | {ms(figure(figures, 'tpot_ms', 'p50'))} "
                         f"| {sum(figures['errors'].values())} | {'—' if hit_rate is None else f'{hit_rate:.0%}'} |")
        lines.append(f"| on / off | {ratio(figure(side[on], 'qps'), figure(side[off], 'qps'))} "
                     f"| {ratio(figure(side[on], 'ttft_ms', 'p50'), figure(side[off], 'ttft_ms', 'p50'))} / "
                     f"{ratio(figure(side[on], 'ttft_ms', 'p99'), figure(side[off], 'ttft_ms', 'p99'))} "
                     f"| {ratio(figure(side[on], 'tpot_ms', 'p50'), figure(side[off], 'tpot_ms', 'p50'))} | | |")
        parts.append("\n".join(lines))
    missing = [w for w in PREFIX_CACHING_WORKLOADS if w not in found]
    shared = WORKLOADS["shared-prefix"]
    mix = shared.shared_prefixes
    suffixes = ", ".join(map(str, mix.suffix_lengths[:-1])) + f" or {mix.suffix_lengths[-1]}"
    notes = (f"`shared-prefix`: {mix.count} prefixes of {mix.length} ids, every request one of them followed by a suffix of "
             f"its own ({suffixes} ids), {shared.max_new_tokens} new tokens; `default` and `mixed` share nothing, so caching can only cost there. "
             f"Chapter 8 with `{PREFIX_CACHING_VARIANTS[on]}` and with `{PREFIX_CACHING_VARIANTS[off]}`, round by round and in reverse order every other round, the same "
             "users and prompts for both. Prompt tokens found cached: the server's `/stats` at the end of the kept round "
             "(`scheduler.prefix_cache.hit_rate`, over its whole run, warm-up included). How the servers ran: " + "; ".join(sorted(settings)) + ". Reproduce: "
             + "; ".join(commands) + ".")
    if missing:
        notes += " Not measured yet: " + "; ".join(f"`{prefix_caching_command(w, results_dir)}`" for w in missing) + "."
    return "\n\n".join([*parts, notes])


def side_by_side_block(directory: Path, folder: str = "side-by-side") -> str:
    """Chapter 6 against chapter 8, several rounds of ``benchmarks.harness.streaming compare`` (``<dir>/ch08/<folder>/*.json``):
    the median of the rounds per chapter, and chapter 8's over chapter 6's."""
    streamed = ("P99 is of the whole answer; chapter 8 streams." if not folder.endswith("no-stream") else
                "Every answer whole, chapter 8's too (`--no-stream`): its TTFT is its whole answer's time.")
    block = chapter_pair_block(directory / "ch08" / folder, "ch06", "ch08", (
        ". Both servers at their defaults (chapter 5's engine by its rule, chapter 8's attention by its rule). " + streamed))
    variants: dict[str, str] = {}  # label -> flags, of any --variant the same rounds also ran
    for path in sorted((directory / "ch08" / folder).glob("*.json")):
        variants.update({label: v["flags"] for label, v in json.loads(path.read_text())["variants"].items()
                         if label not in ("ch06", "ch08")})
    for label, flags in sorted(variants.items()):
        table = chapter_pair_block(directory / "ch08" / folder, "ch06", label, "").split("\n\nReproduce")[0]
        block += f"\n\nIn the same rounds, `{label}`: chapter 8 with `{flags}`:\n\n" + table
    return block


STREAM_INTERVAL_DIR = "side-by-side-avx2-stream-interval"


def stream_interval_block(directory: Path) -> str:
    """Chapter 8 at several ``--stream-interval`` settings beside chapter 6, in the same rounds of
    ``benchmarks.harness.streaming compare`` (``<dir>/ch08/side-by-side-avx2-stream-interval/*.json``): per workload and
    server, the median of the rounds, over chapter 6's, with the streamed gaps between token events (ITL)."""
    import statistics

    folder = directory / "ch08" / STREAM_INTERVAL_DIR
    rounds = _compare_rounds(folder)
    if not rounds:
        return (f"*No rounds yet: `python -m benchmarks.harness.streaming compare --chapters ch06 ch08 --variant "
                f"ch08-interval4=ch08:--stream-interval=4 ... --out {repo_path(folder)}/NAME.json`.*")

    def interval(run: dict, label: str) -> str:
        variant = run["variants"][label]
        if variant["chapter"] != "ch08":
            return "— (whole answers)"
        found = re.search(r"--stream-interval[= ](\d+)", variant["flags"])
        return found.group(1) if found else "1"

    lines = ["| workload | users | rounds | server | stream interval | QPS | / ch06 | P99 (ms) | / ch06 P99 | TTFT P99 (ms) "
             "| ITL P50 / P99 (ms) | errors |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (workload, users), runs in sorted(_by_load(rounds).items()):
        def median(label: str, pick) -> float | None:
            values = [pick(run["chapters"][label]) for run in runs if label in run["chapters"]]
            values = [v for v in values if v is not None]
            return statistics.median(values) if values else None
        labels = list(runs[0]["chapters"])
        base_qps, base_p99 = median("ch06", lambda f: f["qps"]), median("ch06", lambda f: f["e2e_ms"]["p99"])
        for label in labels:
            qps, p99 = median(label, lambda f: f["qps"]), median(label, lambda f: f["e2e_ms"]["p99"])
            ttft = median(label, lambda f: f["ttft_ms"]["p99"])
            itl50 = median(label, lambda f: (f["itl_ms"] or {}).get("p50"))  # None: whole answers
            itl99 = median(label, lambda f: (f["itl_ms"] or {}).get("p99"))
            itl = "—" if itl50 is None else f"{itl50:,.0f} / {itl99:,.0f}"
            errors = sum(sum(run["chapters"][label]["errors"].values()) for run in runs)
            lines.append(f"| {workload} | {users} | {len(runs)} | {label} | {interval(runs[0], label)} | {qps:.1f} "
                         f"| {qps / base_qps:.2f}× | {p99:,.0f} | {p99 / base_p99:.2f}× | {ttft:,.0f} | {itl} | {errors} |")
    commands, settings = _reproduce(rounds)
    return ("\n".join(lines) + "\n\nThe median of the rounds per server; every server ran in every round. ITL: the gap between "
            "two token events of one stream as the client reads them (zero within one write). Reproduce (one file per round; "
            "the rounds alternate workloads): " + commands + ". How they ran: " + settings + ".")


# Chapter 8's targets against chapter 6 at 64 users (issue 17): (what, workload, what a round gives, the bound, "min" or "max").
CH08_RATIO_TARGETS = (
    ("QPS, chapter 8 over chapter 6", "default", "qps", 1.3, "min"),
    ("P99, chapter 8 over chapter 6", "default", "p99", 1.0, "max"),
    ("QPS, chapter 8 over chapter 6", "mixed", "qps", 4.0, "min"),
    ("P99, chapter 8 over chapter 6", "mixed", "p99", 0.75, "max"),
)
# The folders of ``benchmarks.harness.streaming compare`` rounds that measure them: the last machine's streamed rounds and its
# rounds with whole answers, then the first machine's streamed rounds (native bf16).
CH08_RATIO_FOLDERS = ("side-by-side-avx2-streamed-collector", "side-by-side-avx2-waiting-no-stream")
CH08_TTFT_TARGET = (32, "side-by-side-avx2", 500.0)  # users, folder, chapter 8's TTFT P99 at most (ms), on both workloads
CH08_SCHEDULER_SHARE_TARGET = 15.0  # schedule + prepare + update, at most this percent of a step
# The in-process profiles of a step at 64 running sequences, one per workload, as served on that machine.
CH08_TARGET_PROFILES = (("default", "profile-avx2-kernel-fp32-blocks128-default.txt"),
                        ("mixed", "profile-avx2-kernel-fp32-blocks128-mixed.txt"))
CH08_TARGET_CLIMB = "climb-avx2"  # the whole climb, every chapter, under the cpu reference


def ch08_targets_block(directory: Path) -> str:
    """Where chapter 8's targets stand: each one against the committed rounds (or profile, or climb) that measure it,
    as the tables of those rounds read them (a ratio of the two chapters' medians), every round's own value, and
    whether the figure meets the bound."""
    import statistics

    def figure(runs: list[dict], pick: str) -> float:
        def median(chapter: str, of) -> float:
            return statistics.median(of(run["chapters"][chapter]) for run in runs)
        if pick == "ttft":
            return median("ch08", lambda f: f["ttft_ms"]["p99"])
        if pick == "qps":
            return median("ch08", lambda f: f["qps"]) / median("ch06", lambda f: f["qps"])
        return median("ch08", lambda f: f["e2e_ms"]["p99"]) / median("ch06", lambda f: f["e2e_ms"]["p99"])

    def shown(value: float, pick: str) -> str:
        return f"{value:,.0f}" if pick == "ttft" else f"{value:.2f}×"

    def met(value: float, bound: float, sense: str) -> str:
        return "yes" if (value >= bound if sense == "min" else value <= bound) else "**no**"

    lines = ["| target | workload | users | measured in | chapter 8 at | rounds | figure | each round | bound | met |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    machines: dict[str, set[str]] = {}  # folder -> the machines its rounds ran on, and the engines served
    ttft_users, ttft_folder, ttft_bound = CH08_TTFT_TARGET
    measured = [(what, workload, 64, folder, pick, bound, sense)
                for folder in CH08_RATIO_FOLDERS for what, workload, pick, bound, sense in CH08_RATIO_TARGETS]
    measured += [("chapter 8's TTFT P99 (ms)", workload, ttft_users, ttft_folder, "ttft", ttft_bound, "max")
                 for workload in ("default", "mixed")]
    for what, workload, users, folder, pick, bound, sense in measured:
        runs = [run for run in _compare_rounds(directory / "ch08" / folder)
                if run["workload"] == workload and run["users"] == users]
        how = "whole answers" if folder.endswith("no-stream") else "streamed"
        if not runs:
            lines.append(f"| {what} | {workload} | {users} | `{folder}/` ({how}) | — | 0 | not measured | — | — | — |")
            continue
        value = figure(runs, pick)
        commits = ", ".join(sorted({f"`{run['harness']['git_commit'][:7]}`" for run in runs}))
        machines.setdefault(folder, set()).update(
            f"{run['harness']['cpu']} (chapter 6 "
            f"{run['chapters']['ch06']['engine']['precision']}, chapter 8 {run['chapters']['ch08']['engine']['precision']})"
            for run in runs)
        sign = ">=" if sense == "min" else "<="
        lines.append(f"| {what} | {workload} | {users} | `{folder}/` ({how}) | {commits} | {len(runs)} | {shown(value, pick)} "
                     f"| {' / '.join(shown(figure([run], pick), pick) for run in runs)} | {sign} {shown(bound, pick)} "
                     f"| {met(value, bound, sense)} |")
    for workload, name in CH08_TARGET_PROFILES:
        text = (directory / "ch08" / name).read_text() if (directory / "ch08" / name).exists() else ""
        share = re.search(r"schedule \+ prepare \+ update = ([\d.]+)%", text)
        running = re.search(r"running (\d+),", text)
        if share is None or running is None:
            lines.append(f"| schedule + prepare + update, share of a step | {workload} | — | `{name}` | — | — | not measured "
                         f"| — | <= {CH08_SCHEDULER_SHARE_TARGET:.0f}% | — |")
            continue
        value = float(share.group(1))
        lines.append(f"| schedule + prepare + update, share of a step | {workload} | {running.group(1)} running "
                     f"| `{name}` (in process, median step) | — | — | {value:.1f}% | — | <= {CH08_SCHEDULER_SHARE_TARGET:.0f}% "
                     f"| {met(value, CH08_SCHEDULER_SHARE_TARGET, 'max')} |")
    climb = load_results(directory / CH08_TARGET_CLIMB, "default") if (directory / CH08_TARGET_CLIMB).exists() else {}
    rows = {r.chapter: measured_row(r, None) for r in climb.values() if r.label == r.chapter}
    if "ch08" in rows and len(rows) > 1:
        best_other = max((c for c in rows if c != "ch08"), key=lambda c: rows[c].qps)
        value = rows["ch08"].qps / rows[best_other].qps
        commit = (climb["ch08"].environment.git_commit or "")[:7]
        ours, base = rows["ch08"], rows.get("ch06")
        if base is not None and base.top_users == ours.top_users:  # the default targets, as the climb measures them
            where = f"| `{CH08_TARGET_CLIMB}/` (Locust, whole answers) | `{commit}` | each chapter's median run "
            for what, workload, pick, bound, sense in CH08_RATIO_TARGETS:
                if workload != "default":
                    continue
                ratio, users = ((ours.qps / base.qps, f"best level (ch06 {base.users}, ch08 {ours.users})") if pick == "qps"
                                 else (ours.p99_top_ms / base.p99_top_ms, str(ours.top_users)))
                lines.append(f"| {what} | default | {users} {where}| {ratio:.2f}× | — | {'>=' if sense == 'min' else '<='} "
                             f"{bound:.2f}× | {met(ratio, bound, sense)} |")
        lines.append(f"| the climb's highest bar: chapter 8's QPS over the best other chapter's ({best_other}) | default "
                     f"| best level | `{CH08_TARGET_CLIMB}/` (Locust, whole answers) | `{commit}` | each chapter's median run "
                     f"| {value:.2f}× | — | > 1.00× | {met(value, 1.0 + 1e-9, 'min')} |")
    else:
        lines.append(f"| the climb's highest bar | default | — | `{CH08_TARGET_CLIMB}/` | — | 0 | not measured | — | > 1.00× | — |")
    lines += _vllm_peer_target_rows(directory)
    lines += _real_model_peer_target_rows(directory)
    lines += _prefix_caching_target_rows(directory)
    return ("\n".join(lines) + "\n\nEach row reads the committed files it names (under `" + repo_path(directory) + "/ch08/`, "
            "the climb under `" + repo_path(directory) + "/`). A ratio is of the two chapters' medians over the rounds, as the "
            "tables of those folders below read it; `each round` is every round's own. The rounds of one folder ran in one "
            "sitting, chapter 6 and chapter 8 taking turns. Where they ran: " + "; ".join(
                f"`{folder}/` on {', '.join(sorted(where))}" for folder, where in machines.items()) + ".")


# Issue 46's bounds: chapter 8's QPS over vLLM's CPU backend's, per workload, whole answers and streamed.
VLLM_PEER_TARGETS = {"default": 1.5, "mixed": 1.5, "shared-prefix": 1.2}


def _vllm_peer_target_rows(directory: Path) -> list[str]:
    """One targets row per committed vLLM side-by-side file (``benchmarks.studies.vllm_peer``): the ratio of medians.
    ``vllm-peer/`` first, then a folder per other kind of core (``vllm-peer-<machine>/``); each row names its CPU."""
    import json

    from benchmarks.report.peer_blocks import VLLM_PEER_DIR

    folders = [directory / VLLM_PEER_DIR, *sorted(directory.glob(f"{VLLM_PEER_DIR}-*"))]
    rows = []
    for folder in folders:
        runs = [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))] if folder.is_dir() else []
        for run in sorted(runs, key=lambda run: (list(VLLM_PEER_TARGETS).index(run["workload"]) if run["workload"] in VLLM_PEER_TARGETS else 9,
                                                run["answers"] != "whole")):
            bound = VLLM_PEER_TARGETS.get(run["workload"])
            if bound is None:
                continue
            ours, peer = run["chapters"]["ch08"], run["chapters"]["vllm"]
            value = ours["qps"] / peer["qps"]
            each = " / ".join(f"{a['qps'] / b['qps']:.2f}×" for a, b in zip(ours.get("rounds") or [ours], peer.get("rounds") or [peer], strict=False))
            how = "streamed" if run["answers"] == "stream" else "whole answers"
            cpu = run["harness"]["cpu"]
            rows.append(f"| chapter 8's QPS over vLLM's CPU backend's | {run['workload']} | {run['users']} | `{folder.name}/` ({how}; {cpu}) "
                        f"| `{(run['harness']['git_commit'] or '')[:7]}` | {run['rounds']} | {value:.2f}× | {each} | >= {bound:.2f}× "
                        f"| {'yes' if value >= bound else '**no**'} |")
    return rows or ["| chapter 8's QPS over vLLM's CPU backend's | default, mixed, shared-prefix | 64 | `vllm-peer/` | — | 0 "
                    "| not measured: `python -m benchmarks.studies.vllm_peer.peer compare` | — | — | — |"]


# Issue 61's bounds on the real model: chapter 8's QPS over each peer's, every workload and answer kind.
REAL_MODEL_PEER_TARGETS = {"vllm": ("vLLM's CPU backend's", 1.2), "llama-f16": ("llama-server's at F16", 1.0)}


def _real_model_peer_target_rows(directory: Path) -> list[str]:
    """One targets row per peer with a bound and per committed file of ``benchmarks.studies.real_model_peers``."""
    import json

    from benchmarks.report.peer_blocks import REAL_MODEL_PEERS_DIR

    folder = directory / REAL_MODEL_PEERS_DIR
    runs = [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))] if folder.is_dir() else []
    runs = [run for run in runs if run.get("kind") == "real-model-peers"]
    rows = []
    for label, (name, bound) in REAL_MODEL_PEER_TARGETS.items():
        for run in sorted(runs, key=lambda run: (run["workload"] != "default", run["workload"], run["answers"] != "whole")):
            ours, peer = run["chapters"]["ch08"], run["chapters"].get(label)
            if peer is None:
                continue
            value = ours["qps"] / peer["qps"]
            each = " / ".join(f"{a['qps'] / b['qps']:.2f}×" for a, b in zip(ours.get("rounds") or [ours], peer.get("rounds") or [peer], strict=False))
            how = "streamed" if run["answers"] == "stream" else "whole answers"
            rows.append(f"| chapter 8's QPS over {name}, SmolLM2 | {run['workload']} | {run['users']} | `{folder.name}/` ({how}; "
                        f"{run['harness']['cpu']}) | `{(run['harness']['git_commit'] or '')[:7]}` "
                        f"| {run['rounds']} | {value:.2f}× | {each} | >= {bound:.2f}× | {'yes' if value >= bound else '**no**'} |")
    return rows


# Issue 46's bound on prefix caching: TTFT P50 with caching on over off, on shared prompts.
PREFIX_CACHING_TTFT_TARGET = 1 / 3


def _prefix_caching_target_rows(directory: Path) -> list[str]:
    """The TTFT rows of the committed shared-prefix comparisons (``<dir>/ch08/prefix-caching/shared-prefix*.json``, one
    per load, fewest users first): the ratio of the two variants' TTFT P50 in their median-QPS rounds, and each round's
    (in the order they ran)."""
    from benchmarks.harness.streaming import PREFIX_CACHING_DIR, PREFIX_CACHING_VARIANTS

    folder = directory / PREFIX_CACHING_DIR
    what = "TTFT P50, prefix caching on over off"
    runs = [json.loads(path.read_text()) for path in sorted(folder.glob("shared-prefix*.json"))] if folder.exists() else []
    if not runs:
        return [f"| {what} | shared-prefix | — | `{PREFIX_CACHING_DIR}/` | — | 0 | not measured | — | <= 0.33× | — |"]
    rows = []
    for run in sorted(runs, key=lambda run: run["users"]):
        on, off = (run["chapters"][label] for label in PREFIX_CACHING_VARIANTS)
        value = on["ttft_ms"]["p50"] / off["ttft_ms"]["p50"]
        each = " / ".join(f"{a['ttft_ms']['p50'] / b['ttft_ms']['p50']:.2f}×"
                          for a, b in zip(on.get("rounds") or [on], off.get("rounds") or [off], strict=False))
        rows.append(f"| {what} | shared-prefix | {run['users']} | `{PREFIX_CACHING_DIR.removeprefix('ch08/')}/` (streamed) "
                    f"| `{(run['harness']['git_commit'] or '')[:7]}` | {run['rounds']} | {value:.2f}× | {each} "
                    f"| <= {PREFIX_CACHING_TTFT_TARGET:.2f}× | {'yes' if value <= PREFIX_CACHING_TTFT_TARGET else '**no**'} |")
    return rows


def deploy_block(directory: Path) -> str:
    """Chapter 7 against chapter 8 at the same load (``<dir>/ch08/deploy/*.json``): the two servers one would deploy."""
    return chapter_pair_block(directory / "ch08" / "deploy", "ch07", "ch08", (
        ". Both servers at their defaults, each inside chapter 7's production shell. QPS: answers per second; P99: of "
        "the whole answer (ms); TTFT: chapter 8's time to its first streamed token (ms; chapter 7 answers all at once)."))


def chapter_pair_block(folder: Path, base: str, other: str, note: str) -> str:
    """Two chapters measured in the same rounds of ``benchmarks.harness.streaming compare`` (one JSON file per round in
    ``folder``): per workload and load, the median of the rounds per chapter and ``other``'s over ``base``'s."""
    import statistics

    rounds = _compare_rounds(folder)
    if not rounds:
        return (f"*No rounds yet: `python -m benchmarks.harness.streaming compare --chapters {base} {other} ... "
                f"--out {repo_path(folder)}/NAME.json`.*")
    lines = [f"| workload | users | rounds | {base} QPS | {other} QPS | {other} / {base} | {base} P99 (ms) | {other} P99 (ms) "
             f"| {other} / {base} P99 | {other} TTFT P99 (ms) | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (workload, users), runs in sorted(_by_load(rounds).items()):
        def median(chapter: str, pick) -> float:
            return statistics.median(pick(run["chapters"][chapter]) for run in runs)
        qps_base, qps_other = median(base, lambda f: f["qps"]), median(other, lambda f: f["qps"])
        p99_base, p99_other = median(base, lambda f: f["e2e_ms"]["p99"]), median(other, lambda f: f["e2e_ms"]["p99"])
        ttft = median(other, lambda f: f["ttft_ms"]["p99"])
        errors = sum(sum(f["errors"].values()) for run in runs for f in run["chapters"].values())
        lines.append(f"| {workload} | {users} | {len(runs)} | {qps_base:.1f} | {qps_other:.1f} | {qps_other / qps_base:.2f}× "
                     f"| {p99_base:,.0f} | {p99_other:,.0f} | {p99_other / p99_base:.2f}× | {ttft:,.0f} | {errors} |")
    commands, settings = _reproduce(rounds)
    return ("\n".join(lines) + "\n\nReproduce (one file per round; the rounds alternate workloads): " + commands
            + note + " How they ran: " + settings + ".")


def _compare_rounds(folder: Path) -> list[dict]:
    """Every round of ``benchmarks.harness.streaming compare`` in ``folder`` (one JSON file each), in the files' order."""
    return [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))] if folder.exists() else []


def _by_load(rounds: list[dict]) -> dict[tuple[str, int], list[dict]]:
    """The rounds per (workload, users)."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for run in rounds:
        groups.setdefault((run["workload"], run["users"]), []).append(run)
    return groups


def _reproduce(rounds: list[dict]) -> tuple[str, str]:
    """The rounds' commands, and how their servers and client ran, each joined for a README sentence."""
    from benchmarks.harness.streaming import describe_harness

    commands = sorted({f"`{current_command(run['command'])}`" for run in rounds})
    settings = sorted({describe_harness(run["harness"]) for run in rounds})
    return "; ".join(commands), "; ".join(settings)
