"""README blocks of the peers: other servers measured on the same model, core and client as chapter 8.

``vllm-peer``: vLLM's CPU backend beside chapter 8, from ``benchmarks.studies.vllm_peer.peer compare``
(one JSON per workload and answer kind under ``<dir>/vllm-peer/``; ``vllm-peer-<machine>``: the same from
``<dir>/vllm-peer-<machine>/``, another kind of core).
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.report.paths import current_command, repo_path

VLLM_PEER_DIR = "vllm-peer"
VLLM_PEER_COMMAND = ("python -m benchmarks.studies.vllm_peer.peer compare --workloads default mixed shared-prefix "
                     "--answers whole stream --users 64 --duration-s 25 --rounds 3")
_WORKLOAD_ORDER = {"default": 0, "mixed": 1, "shared-prefix": 2}


def _rounds(figures: dict) -> list[dict]:
    """A server's every round (a file keeps them under ``rounds`` when there were several)."""
    return figures.get("rounds") or [figures]


def _seconds(figures: dict, what: str, pick: str) -> float:
    return figures[what][pick] / 1e3


def vllm_peer_block(directory: Path, folder_name: str = VLLM_PEER_DIR) -> str:
    """Chapter 8 against vLLM's CPU backend, one row per workload and answer kind: each server's median-QPS round,
    the ratio of those and of every round (round i of one against round i of the other), the tails and first tokens.
    ``folder_name``: the folder of ``directory`` the files are in (one per kind of core)."""
    folder = directory / folder_name
    files = sorted(folder.glob("*.json")) if folder.exists() else []
    runs = [json.loads(path.read_text()) for path in files]
    runs = [run for run in runs if run.get("kind") == "vllm-peer"]
    if not runs:
        return (f"*Not measured yet: `{VLLM_PEER_COMMAND} --out-dir {repo_path(folder)}` records it "
                "(vLLM installed first: `bash benchmarks/studies/vllm_peer/setup_venv.sh`).*")
    lines = ["| workload | answers | users | rounds | ch08 QPS | vLLM QPS | ch08 / vLLM (each round) | P99 ch08 / vLLM (s) "
             "| TTFT P50 ch08 / vLLM (ms) | TTFT P99 ch08 / vLLM (ms) | errors, short answers |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    runs.sort(key=lambda run: (_WORKLOAD_ORDER.get(run["workload"], 9), run["workload"], run["answers"] != "whole"))
    for run in runs:
        peer = run["chapters"]["vllm"]
        streamed = run["answers"] == "stream"
        for label, answers in (("ch08", "streamed" if streamed else "whole"), ("ch08-inference", "whole, ch08 on `/v1/inference`")):
            if label not in run["chapters"]:
                continue
            ours = run["chapters"][label]
            each = ", ".join(f"{a['qps'] / b['qps']:.2f}" for a, b in zip(_rounds(ours), _rounds(peer)))
            ttft50 = f"{ours['ttft_ms']['p50']:,.0f} / {peer['ttft_ms']['p50']:,.0f}" if streamed else "—"
            ttft99 = f"{ours['ttft_ms']['p99']:,.0f} / {peer['ttft_ms']['p99']:,.0f}" if streamed else "—"
            errors = sum(sum(r["errors"].values()) for f in (ours, peer) for r in _rounds(f))
            short = sum(r.get("short_answers", 0) for f in (ours, peer) for r in _rounds(f))
            lines.append(f"| `{run['workload']}` | {answers} | {run['users']} | {run['rounds']} "
                         f"| {ours['qps']:.1f} | {peer['qps']:.1f} | {ours['qps'] / peer['qps']:.2f}× ({each}) "
                         f"| {_seconds(ours, 'e2e_ms', 'p99'):.2f} / {_seconds(peer, 'e2e_ms', 'p99'):.2f} | {ttft50} | {ttft99} "
                         f"| {errors}, {short} |")
    return "\n".join(lines) + "\n\n" + _how(runs, folder)


def _provenance(runs: list[dict]) -> tuple[str, str, str]:
    """The files' commands, how their servers ran, and the commits they ran at, each as one phrase."""
    from benchmarks.harness.streaming import describe_harness

    commands = "; ".join(sorted({f"`{current_command(run['command'])}`" for run in runs}))
    settings = "; ".join(sorted({describe_harness(run.get("harness")) for run in runs}))
    commits = ", ".join(sorted({f"`{(run['harness'].get('git_commit') or '')[:7]}`"
                                + (" with uncommitted changes (the next commit's code)" if run["harness"].get("git_dirty") else "")
                                for run in runs}))
    return commands, settings, commits


def _how(runs: list[dict], folder: Path) -> str:
    """The sentence under the table: the commands, how the servers ran, what vLLM was."""
    commands, settings, commits = _provenance(runs)
    vllm = sorted({f"vLLM {run['servers']['vllm'].get('version') or '(version not recorded)'} at {run['servers']['vllm']['dtype']}"
                   for run in runs})
    # what chapter 8's start-up rules chose in each file's median round (they measure, so a day may differ)
    chose = sorted({f"{engine['engine']}/{engine['precision']}" + (f" with {ours['attention']} attention" if ours.get("attention") else "")
                    for run in runs for ours in [run["chapters"]["ch08"]] if (engine := ours.get("engine"))})
    own_route = (" (the `/v1/inference` rows: chapter 8's own route, the same prompts, in the same server start as the row "
                 "above them)") if any("ch08-inference" in run["chapters"] for run in runs) else ""
    return (f"Each row is one file of `{repo_path(folder)}/` (`<workload>-<whole|stream>.json`): per server its round of median "
            "QPS; the rounds alternate the two servers, each started fresh, and `each round` pairs them in order. P99 is of the "
            "whole answer; TTFT is the first streamed token. Both served the embedded model (vLLM its Hugging Face export, "
            f"`export_hf.py`) to the same streaming client on OpenAI's `/v1/completions`{own_route}; {', '.join(vllm)}, chapter 8 at its "
            f"defaults{' (it chose ' + ', '.join(chose) + ')' if chose else ''}. Reproduce: {commands}. How they ran: {settings}. Commits: {commits}.")


REAL_MODEL_PEERS_DIR = "real-model-peers"
REAL_MODEL_PEERS_COMMAND = ("python -m benchmarks.studies.real_model_peers.peers compare --workloads default chat "
                            "--answers whole stream --users 64 --duration-s 30 --rounds 3")
_SERVER_NAMES = {"ch08": "chapter 8 ({ch08})", "ch08-inference": "chapter 8 ({ch08}), `/v1/inference`",
                 "vllm": "vLLM CPU ({vllm})", "llama-f16": "llama-server F16", "llama-q4_1": "llama-server Q4_1"}


def _server_name(label: str, run: dict) -> str:
    """A row's server, with the precision its file says it ran at (chapter 8's last ``--precision``, vLLM's dtype)."""
    servers = run.get("servers", {})
    flags = [flag for flag in servers.get("ch08", {}).get("flags", "").split() if flag.startswith("--precision")]
    ch08 = flags[-1].split("=", 1)[1] if flags else "bf16"
    vllm = {"bfloat16": "bf16", "float32": "fp32"}.get(servers.get("vllm", {}).get("dtype", "bfloat16"), "bf16")
    return _SERVER_NAMES.get(label, label).format(ch08=ch08, vllm=vllm)


def real_model_peers_block(directory: Path, folder_name: str = REAL_MODEL_PEERS_DIR) -> str:
    """Chapter 8, vLLM's CPU backend and llama.cpp's server on SmolLM2, one row per server for each workload and
    answer kind: its median-QPS round, chapter 8's QPS over its (the ratio of medians, then round by round),
    output tokens per second, the tails and the first tokens. ``folder_name``: one folder per kind of core."""
    folder = directory / folder_name
    runs = [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))] if folder.exists() else []
    runs = [run for run in runs if run.get("kind") == "real-model-peers"]
    if not runs:
        return (f"*Not measured yet: `{REAL_MODEL_PEERS_COMMAND}` records it (the peers built and the weights exported "
                "first: see `benchmarks/studies/real_model_peers/README.md`).*")
    lines = ["| workload | answers | server | QPS | tokens/s | ch08 / it (each round) | P99 (s) | TTFT P50 / P99 (ms) "
             "| errors, short answers, reconnects |", "|---|---|---|---|---|---|---|---|---|"]
    runs.sort(key=lambda run: (_WORKLOAD_ORDER.get(run["workload"], 9), run["workload"], run["answers"] != "whole"))
    for run in runs:
        ours = run["chapters"]["ch08"]
        streamed = run["answers"] == "stream"
        for label, figures in run["chapters"].items():
            ratio = "—" if label.startswith("ch08") else (f"{ours['qps'] / figures['qps']:.2f}× ("
                                                 + ", ".join(f"{a['qps'] / b['qps']:.2f}" for a, b in zip(_rounds(ours), _rounds(figures))) + ")")
            ttft = f"{figures['ttft_ms']['p50']:,.0f} / {figures['ttft_ms']['p99']:,.0f}" if streamed else "—"
            errors = sum(sum(r["errors"].values()) for r in _rounds(figures))
            short = sum(r.get("short_answers", 0) for r in _rounds(figures))
            reconnects = sum(r.get("reconnects", 0) for r in _rounds(figures))
            lines.append(f"| `{run['workload']}` | {'streamed' if streamed else 'whole'} | {_server_name(label, run)} "
                         f"| {figures['qps']:.2f} | {figures['output_tokens_per_s']:.0f} | {ratio} "
                         f"| {_seconds(figures, 'e2e_ms', 'p99'):.1f} | {ttft} | {errors}, {short}, {reconnects} |")
    return "\n".join(lines) + "\n\n" + _real_model_how(runs, folder)


def _server_starts(runs: list[dict]) -> str:
    """When the table's servers were started: for each round, workload and answer kind (documents that say
    ``server_starts``), or once a round for every workload and answer kind in turn (older documents)."""
    fresh = sorted(f"`{run['workload']}-{'stream' if run['answers'] == 'stream' else 'whole'}`" for run in runs
                   if run.get("server_starts"))
    if len(fresh) == len(runs):
        return "for each round, workload and answer kind"
    if not fresh:
        return "each round and measured on each of its workloads and answer kinds in turn"
    return (f"for each round, workload and answer kind in {', '.join(fresh)}, and in the other files once a round, "
            "measured on each of its workloads and answer kinds in turn")


def _real_model_how(runs: list[dict], folder: Path) -> str:
    """The sentence under the real model's table: the command, how each server ran, its version."""
    commands, settings, commits = _provenance(runs)
    servers = {label: server for run in runs for label, server in run["servers"].items()}
    started = "; ".join(f"{_server_name(label, runs[0])}: `{server.get('flags') or server.get('command')}`"
                        + (f" ({', '.join(f'{k} {v}' for k, v in server['packages'].items())})" if server.get("packages") else "")
                        + (f" ({server['version']})" if server.get("version") else "")
                        for label, server in servers.items())
    return (f"Each row is one server in one file of `{repo_path(folder)}/` (`<workload>-<whole|stream>.json`): its round of "
            f"median QPS; every server is started fresh {_server_starts(runs)}, in turns reversed every other round, and `each round` "
            "pairs chapter 8's rounds with its in order. Tokens/s counts generated tokens; P99 is of the whole answer; TTFT "
            "is the first streamed token. `short answers` are answers that ended before `max_tokens`: on `chat` every server "
            "stops at the model's end of turn, on `default` the peers are sent `ignore_eos`; `reconnects`, requests sent again "
            "on a new connection after the server had closed a kept-alive one. All on OpenAI's routes "
            "(`/v1/completions`, `/v1/chat/completions` for `chat`) but the `/v1/inference` rows: chapter 8's own route, "
            f"the same prompts, in the same server start as its row above. Reproduce: {commands}. Servers: {started}. "
            f"How they ran: {settings}. Commits: {commits}.")


REAL_MODEL_ENGINE_LOOPS = "real-model-peers/engine-loops.json"  # one file per kind of CPU: engine-loops-avx2.json beside it


def real_model_engine_loops_block(directory: Path) -> str:
    """Chapter 8's engine and vLLM's, each in its own closed loop with no HTTP (``engine_loops compare``), one table per
    file (CPU): requests per second of the median round, chapter 8's over vLLM's (the ratio of medians, then round by
    round)."""
    first = directory / REAL_MODEL_ENGINE_LOOPS
    paths = sorted(first.parent.glob(f"{first.stem}*.json"), key=lambda path: (path != first, path.name))
    if not paths:
        return ("*Not measured yet: `python -m benchmarks.studies.real_model_peers.engine_loops compare --rounds 3 "
                f"--seconds 30 --out {repo_path(first)}` records it.*")
    return "\n\n".join(_engine_loops_table(path) for path in paths)


_ENGINE_LOOPS_COUNTED = {  # each file's "requests_counted": its table's column, and the sentence on what it resolves
    "Little's law": (
        "requests/s (running ÷ mean life)",
        " Requests per second by Little's law: the requests running (always {running}) over the mean life of those that "
        "finished in the window; the loop's requests (all of one length) finish in cohorts, so a count of finished ones "
        "moves in steps of a cohort, and a count of generated tokens with where in a cohort's life the window ends."),
    "between finishes": (
        "requests/s (between finishes)",
        " Requests counted from the window's first step that finished any to its last, over the time between; where a "
        "cohort's finishes spread over several steps this leans on how they spread, so read each ratio as good to about "
        "a cohort (newer files count by Little's law)."),
    None: (
        "requests/s",
        " Counted as every request finished in the window; the loop's requests (all of one length) finish in cohorts "
        "of up to {running}, so a round's count, and each ratio, moves in steps of a cohort (newer files count by "
        "Little's law)."),
}


def _engine_loops_table(path: Path) -> str:
    """One file's table, its requests counted as the file says (``engine_loops.closed_loop`` counts by Little's law;
    older files counted finished requests, and say what that resolves)."""
    document = json.loads(path.read_text())
    column, counted = _ENGINE_LOOPS_COUNTED[document.get("requests_counted")]
    generated = "generated_per_s" in next(iter(document["runs"].values()))[0]
    header = f"| engine | {column} | {'tokens generated/s' if generated else 'tokens computed/s'} | it / vLLM (each round) |"
    lines = [f"**{document['cpu']}, {document['dtype']}**", "", header, "|---|---|---|---|"]
    for engine, runs in document["runs"].items():
        median = sorted(runs, key=lambda run: run["requests_per_s"])[len(runs) // 2]
        ratio = "—" if engine == "vllm" else (f"{document['over_vllm'][engine]:.2f}× ("
                                              + ", ".join(f"{r:.2f}" for r in document["over_vllm_each_round"][engine]) + ")")
        second = f"{median['generated_per_s']:,.0f}" if generated else f"{median['tokens_per_s']:,.0f}"
        lines.append(f"| {median['label']} | {median['requests_per_s']:.2f} | {second} | {ratio} |")
    counted = counted.format(running=document["running"])
    return ("\n".join(lines) + f"\n\nFrom `{repo_path(path)}`: {len(document['runs']['vllm'])} rounds of "
            f"{document['seconds']:g} s each, the engines in turns, each in a fresh process pinned to core(s) "
            f"{document['server_cores']}; {document['running']} requests running, {document['new_tokens']} new tokens, "
            f"prompts of {'/'.join(map(str, document['prompt_lengths']))} random ids.{counted} Reproduce: `{document['command']}`.")
