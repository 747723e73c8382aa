"""Chapter 8 beside vLLM's CPU backend and llama.cpp's server on SmolLM2-135M-Instruct: same core, same client.

Two commands, both run from the project's ``.venv`` (each peer runs as a subprocess from its own build:
vLLM from ``.venv-vllm``, ``setup_venv.sh`` in ``benchmarks/studies/vllm_peer``; ``llama-server`` from
``.llama-cpp``, ``setup_llama_server.sh`` beside this file; the exported weights from ``export.py``):

``check``: the peers' greedy tokens on chat prompts against the oracle (transformers reading the packaged
GGUF at fp32): vLLM at fp32 on the Hugging Face export, llama-server on the F16 GGUF (16-bit weights,
so agreement is reported, not required); exit status 1 when vLLM differs::

    python -m benchmarks.studies.real_model_peers.peers check --out benchmarks/studies/real_model_peers/check.json

``compare``: every server started fresh for each round, in turns (reversed every other round), pinned as
the climb pins a server (``cpu`` profile), measured on each workload and answer kind by the project's
streaming client on OpenAI's routes; one file per workload and answer kind,
``<out-dir>/<workload>-<stream|whole>.json``::

    python -m benchmarks.studies.real_model_peers.peers compare --workloads default chat \\
        --answers whole stream --users 64 --duration-s 30 --rounds 3

The servers and why each is set as it is (every one on loopback, one core, one compute thread):

- ``ch08``: chapter 8 with the profile's flags, ``--weights=smollm2`` and ``--precision=bf16`` (on a core
  with native bf16 products its own profile shows bf16 twice as fast, and chapter 5's rule cannot choose
  it on a Llama: its accuracy check is the toy's task). Context 512, its default for this model.
- ``vllm``: vLLM's CPU backend on the Hugging Face export at bfloat16 (its CPU path's own choice), OpenMP
  bound to the server's core, a 1 GiB KV cache, ``--max-model-len 512`` as chapter 8's context, scheduler
  at its defaults (prefix caching and chunked prefill on).
- ``llama-f16`` / ``llama-q4_1``: ``llama-server`` on the F16 GGUF and on the packaged Q4_1 GGUF itself,
  ``-np`` as many slots as users (each with a 512-token context: ``-c`` slots x 512), continuous batching
  on (its default), one thread for decode and for batches, its web UI off.

On the completion workloads vLLM and llama.cpp are sent ``ignore_eos`` (chapter 8's ``/v1/completions``
never stops at end of turn), so all generate exactly the workload's new tokens. On ``chat`` every server
stops at the model's end of turn, so answers end where the model ends them (greedy, the same weights).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests

from benchmarks.harness.results import REFERENCE_ROOT, dumps_compact, print_and_save
from benchmarks.harness.server_process import RunningServer, free_port, pin_to_cores, running_module, stop
from benchmarks.harness.server_stats import server_choices
from benchmarks.harness.streaming import compare_document, harness_settings, median_round
from benchmarks.studies.real_model_peers.export import F16_GGUF, HF_DIR, LLAMA_CPP_ROOT
from benchmarks.studies.vllm_peer.peer import (DEFAULT_VENV, _kill_group, _repo_relative, _wait_until_ready, measure,
                                               measured_routes, peer_packages, results_path, running_vllm, vllm_command,
                                               vllm_env)
from chapters import module_for
from shared.paths import REPO_ROOT

RESULTS_DIR = REFERENCE_ROOT / "cpu" / "real-model-peers"
WORKLOADS = ("default", "mixed", "shared-prefix", "chat")
ANSWERS = {"stream": True, "whole": False}
SERVERS = ("ch08", "vllm", "llama-f16", "llama-q4_1")
CONTEXT = 512  # chapter 8's served context for this model, given to every server
SERVED_NAME = "smollm2"
CH08_FLAGS = ("--weights=smollm2", "--precision=bf16")
LLAMA_SERVER = LLAMA_CPP_ROOT / "build" / "bin" / "llama-server"
# Completion workloads ask for exactly max_tokens; the peers stop at end of turn unless told not to.
IGNORE_EOS = {"ignore_eos": True}


def request_extra(label: str, workload: str) -> dict[str, Any] | None:
    """The fields a server is sent beyond the workload's: ``ignore_eos`` for the peers on completion workloads."""
    return IGNORE_EOS if label != "ch08" and workload != "chat" else None


def llama_gguf(label: str) -> Path:
    """The file each llama.cpp variant serves: the F16 export, or the packaged Q4_1 GGUF."""
    from shared.weights import smollm2_path

    return F16_GGUF if label == "llama-f16" else smollm2_path()


def llama_command(server: Path, gguf: Path, port: int | str, slots: int) -> list[str]:
    """How ``llama-server`` is started: ``slots`` parallel sequences of :data:`CONTEXT` tokens each, one thread."""
    return [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--alias", SERVED_NAME,
            "-np", str(slots), "-c", str(slots * CONTEXT), "-t", "1", "-tb", "1", "--cont-batching", "--no-webui"]


@contextmanager
def running_llama(gguf: Path, slots: int, cpu_cores: Sequence[int] | None, env: dict[str, str],
                  startup_timeout_s: float = 300.0) -> Iterator[RunningServer]:
    """``llama-server`` on a free loopback port for the block, pinned to ``cpu_cores``; stopped on the way out."""
    if not LLAMA_SERVER.exists():
        raise FileNotFoundError(f"{LLAMA_SERVER} not found: run `bash benchmarks/studies/real_model_peers/setup_llama_server.sh` first")
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
    command = llama_command(LLAMA_SERVER, gguf, port, slots)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, **env}, preexec_fn=pin_to_cores(cpu_cores))
    server = RunningServer(chapter="llama-server", url=f"http://127.0.0.1:{port}", process=process, log_path=log_path, command=command)
    try:
        _wait_until_ready(server, startup_timeout_s)
        yield server
    finally:
        stop(server, grace_s=20.0)
        _kill_group(process.pid)


@contextmanager
def running_server(label: str, args: argparse.Namespace, cores, profile_args: list[str],
                   server_env: dict[str, str]) -> Iterator[RunningServer]:
    """One of :data:`SERVERS`, started fresh and pinned to the server's cores."""
    if label == "ch08":
        with running_module(module_for("ch08"), ch08_flags(profile_args, args), name="ch08", env=server_env,
                            cpu_cores=cores, startup_timeout_s=600.0) as server:
            yield server
    elif label == "vllm":
        with running_vllm(args.vllm_python, args.hf_dir, dtype=args.vllm_dtype, cpu_cores=cores, served_name=SERVED_NAME,
                          max_model_len=CONTEXT, env={**server_env, **vllm_env(cores, args.kv_cache_gib)}) as server:
            yield server
    else:
        with running_llama(llama_gguf(label), args.users, cores, server_env) as server:
            yield server


def ch08_flags(profile_args: list[str], args: argparse.Namespace) -> list[str]:
    """The profile's flags (its ``--weights`` replaced), then :data:`CH08_FLAGS`, then ``--ch08-args``."""
    return [*(a for a in profile_args if not a.startswith("--weights")), *CH08_FLAGS, *shlex.split(args.ch08_args)]


def server_record(label: str, args: argparse.Namespace, cores, profile_args: list[str], server_env: dict[str, str]) -> dict[str, Any]:
    """What a results file says of one server: how it was started, its version, its environment."""
    if label == "ch08":
        return {"module": module_for("ch08"), "flags": shlex.join(ch08_flags(profile_args, args)), "env": server_env}
    if label == "vllm":
        command = vllm_command(Path(".venv-vllm/bin/python"), _repo_relative(args.hf_dir), "PORT", args.vllm_dtype,
                               served_name=SERVED_NAME, max_model_len=CONTEXT)
        return {"packages": peer_packages(args.vllm_python), "dtype": args.vllm_dtype, "command": shlex.join(command),
                "env": {**server_env, **vllm_env(cores, args.kv_cache_gib)}}
    return {"version": llama_version(), "command": shlex.join(llama_command(_repo_relative(LLAMA_SERVER), _repo_relative(llama_gguf(label)), "PORT", args.users)),
            "env": server_env}


def llama_version() -> str | None:
    """What ``llama-server --version`` prints of its build (the version and commit of the vendored sources)."""
    if not LLAMA_SERVER.exists():
        return None
    done = subprocess.run([str(LLAMA_SERVER), "--version"], capture_output=True, text=True, check=False)
    return next((line.strip() for line in (done.stdout + done.stderr).splitlines() if line.startswith("version")), None)


def compare_all(args: argparse.Namespace, harness: dict, profile_args: list[str], server_env: dict[str, str],
                command: str) -> dict[tuple[str, str], dict[str, Any]]:
    """Every round, every workload and answer kind: each server started fresh (in turns, reversed every other round,
    so no row inherits a cache another row warmed) and measured; one document per (workload, answers), each server's
    median-QPS round."""
    cores = harness["server_cores"]
    pairs = [(workload, answers) for workload in args.workloads for answers in args.answers]
    runs: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = {pair: {} for pair in pairs}
    for index in range(args.rounds):
        for workload, answers in pairs:
            for label in args.servers if index % 2 == 0 else args.servers[::-1]:
                with running_server(label, args, cores, profile_args, server_env) as server:
                    for row, route in measured_routes(label, workload, answers):
                        record = measure(server.url, args, workload, ANSWERS[answers], request_extra(label, workload), route)
                        if label == "ch08":
                            record.update(server_choices(server.url))
                        print(f"{workload} {answers} round {index + 1}/{args.rounds} {row}: {record['qps']:.2f} QPS, "
                              f"{record['output_tokens_per_s']:.1f} tokens/s", file=sys.stderr)
                        runs[(workload, answers)].setdefault(row, []).append(record)
    documents = {}
    for (workload, answers), by_label in runs.items():
        document = compare_document(workload, args.users, args.duration_s, {label: median_round(r) for label, r in by_label.items()},
                                    command, args.ch08_args, harness, None, args.rounds)
        document.update(kind="real-model-peers", model="SmolLM2-135M-Instruct", answers=answers, api="openai",
                        server_starts="each round, workload and answers",
                        servers={label: {**server_record(label, args, cores, profile_args, server_env),
                                         "request_extra": request_extra(label, workload) or {}} for label in args.servers})
        documents[(workload, answers)] = document
    return documents


def check_tokens(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Greedy answers to chat prompts (rendered by the model's template, sent as ids, ``ignore_eos``): the
    oracle's, vLLM's at fp32 and llama-server's on the F16 GGUF, one row per prompt."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from benchmarks.harness.streaming import CHAT_QUESTIONS, CHAT_SYSTEM_PROMPT
    from shared.weights import smollm2_path

    gguf = smollm2_path()
    model = LlamaForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    prompts = []
    for question in CHAT_QUESTIONS[: args.prompts]:
        messages = [{"role": "system", "content": CHAT_SYSTEM_PROMPT}, {"role": "user", "content": question}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        prompts.append({"question": question, "ids": ids, "oracle": _greedy(model, ids, args.max_new_tokens)})
    with running_vllm(args.vllm_python, args.hf_dir, dtype="float32", env=vllm_env(None, 1), served_name=SERVED_NAME,
                      max_model_len=CONTEXT) as server:
        for row in prompts:
            body = {"model": SERVED_NAME, "prompt": row["ids"], "max_tokens": args.max_new_tokens, "temperature": 0.0,
                    "return_token_ids": True, **IGNORE_EOS}
            row["vllm"] = requests.post(f"{server.url}/v1/completions", json=body, timeout=300).json()["choices"][0]["token_ids"]
    with running_llama(F16_GGUF, 1, None, {}) as server:
        for row in prompts:
            body = {"prompt": row["ids"], "n_predict": args.max_new_tokens, "temperature": 0.0, "return_tokens": True,
                    "cache_prompt": False, **IGNORE_EOS}
            row["llama_f16"] = requests.post(f"{server.url}/completion", json=body, timeout=300).json()["tokens"]
    return [{"question": row["question"], "oracle": row["oracle"], "vllm": row["vllm"], "vllm_same": row["vllm"] == row["oracle"],
             "llama_f16": row["llama_f16"], "llama_f16_agree": _agreeing_prefix(row["llama_f16"], row["oracle"])} for row in prompts]


def _greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """Exactly ``max_new_tokens`` argmax tokens, end of turn included where it wins (as ``ignore_eos`` asks of the
    peers; ``generate``'s ``min_new_tokens`` would forbid it instead)."""
    import torch

    answer, past, step = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = model(step, past_key_values=past, use_cache=True)
            past = out.past_key_values
            answer.append(int(out.logits[0, -1].argmax()))
            step = torch.tensor([[answer[-1]]])
    return answer


def _agreeing_prefix(tokens: list[int], oracle: list[int]) -> int:
    """How many leading tokens agree with the oracle's."""
    return next((i for i, (a, b) in enumerate(zip(tokens, oracle)) if a != b), min(len(tokens), len(oracle)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.real_model_peers.peers", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("check", "compare"):
        p = sub.add_parser(name)
        p.add_argument("--vllm-python", type=Path, default=DEFAULT_VENV / "bin" / "python", help="the python of vLLM's venv")
        p.add_argument("--hf-dir", type=Path, default=HF_DIR, help="the Hugging Face export (export.py)")
    check = sub.choices["check"]
    check.add_argument("--prompts", type=int, default=4)
    check.add_argument("--max-new-tokens", type=int, default=32)
    check.add_argument("--out", type=Path, default=None, help="write the JSON here as well")
    compare = sub.choices["compare"]
    compare.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    compare.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=["default", "chat"])
    compare.add_argument("--answers", nargs="+", choices=sorted(ANSWERS), default=["whole", "stream"])
    compare.add_argument("--users", type=int, default=64)
    compare.add_argument("--duration-s", type=float, default=30.0)
    compare.add_argument("--rounds", type=int, default=3)
    compare.add_argument("--seed", type=int, default=1234)
    compare.add_argument("--request-timeout-s", type=float, default=300.0, help="a real model's answer under 64 users takes a while")
    compare.add_argument("--vllm-dtype", default="bfloat16")
    compare.add_argument("--kv-cache-gib", type=int, default=1)
    compare.add_argument("--ch08-args", default="", help="flags for chapter 8 after the study's")
    compare.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    needed = [args.hf_dir / "model.safetensors"] + ([F16_GGUF] if "llama-f16" in getattr(args, "servers", ["llama-f16"]) else [])
    missing = [path for path in needed if not path.exists()]
    if missing:
        parser.error(f"missing {', '.join(map(str, missing))}: run `python -m benchmarks.studies.real_model_peers.export` first")
    if args.command == "check":
        rows = check_tokens(args)
        text = dumps_compact({"kind": "real-model-peers-check", "command": "python -m benchmarks.studies.real_model_peers.peers " + shlex.join(argv),
                              "vllm": peer_packages(args.vllm_python), "llama_server": llama_version(),
                              "oracle": "transformers LlamaForCausalLM on the packaged GGUF, fp32", "rows": rows})
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
        sys.exit(0 if all(row["vllm_same"] for row in rows) else 1)
    if args.users < 1 or args.duration_s <= 0 or args.rounds < 1:
        parser.error("--users and --rounds must be at least 1 and --duration-s positive")
    harness, profile_args, server_env = harness_settings("cpu", weights="smollm2")
    command = "python -m benchmarks.studies.real_model_peers.peers " + shlex.join(argv)
    for (workload, answers), document in compare_all(args, harness, profile_args, server_env, command).items():
        print_and_save(document, results_path(args.out_dir, workload, answers))


if __name__ == "__main__":
    main()
