"""Streaming measurement: time to first token, time per output token, inter-token latency, goodput.

Reads each answer as it arrives and records when every token came, with vLLM's benchmark definitions:

- **TTFT**, time to first token: from sending the request to receiving its first token;
- **TPOT**, time per output token: ``(E2E - TTFT) / (output tokens - 1)`` per request, for requests of
  more than one token;
- **ITL**, inter-token latency: every gap between two consecutive tokens of a request, all pooled;
- **E2E**: from sending to the last byte;
- **goodput**: completed requests per second that met every SLO given (TTFT, TPOT, E2E).

Latencies are in milliseconds (mean, P50, P99). A server that does not stream is measured with
``--no-stream``: its first token arrives with its last, so its TTFT is its E2E and TPOT/ITL are ``None``.

Closed loop: ``--users`` clients (aiohttp, one session, a kept-alive connection per user) each send
their next request when the last one ends, for ``--duration-s`` seconds, on loopback only. Workloads
(``--workload``): ``mixed`` (the article's prompt lengths, 8 to 256 new tokens, log-uniform), ``default``
(the climb's, 32 new tokens) and ``shared-prefix`` (:mod:`benchmarks.harness.workload`'s); ``chat`` (a
shared system prompt and one short question) goes to OpenAI's chat route only, through :func:`run_closed_loop`.

    python -m benchmarks.harness.streaming run --url http://127.0.0.1:8000 --users 32 --duration-s 20
    python -m benchmarks.harness.streaming compare --chapters ch06 ch08 --users 32 --duration-s 20 \
        --out benchmarks/reference/cpu/streaming/mixed.json

``run`` measures one server at ``--url`` (``--api openai``: ``POST /v1/completions``, or
``/v1/chat/completions`` for ``chat``, greedy, the model ``GET /v1/models`` names; ``--openai-extra JSON``
adds a server's own fields to every request). ``compare`` starts each chapter in turn and measures them
at the same load: ``--variant LABEL=CHAPTER:FLAGS`` adds a chapter with flags of its own (after
``--server-args``, so its flags win); ``--rounds N`` runs every server N times, round by round, in
reverse order every other round, and keeps each one's median-QPS round (:func:`median_round`);
``--profile cpu`` gives every server the climb's flags, threads and cores, and pins this client to the
load generator's core. The JSON (:func:`compare_document`) records how the servers ran (``harness``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.harness.results import print_and_save
from benchmarks.harness.server_stats import server_choices
from benchmarks.harness.workload import PROMPT_ID_RANGE, PROMPT_LENGTHS
from benchmarks.harness.workload import WORKLOADS as HARNESS_WORKLOADS

MIXED_MIN_NEW, MIXED_MAX_NEW = 8, 256


def mixed_body(rng: random.Random) -> dict[str, Any]:
    """One request of the ``mixed`` workload: an article-mix prompt, 8..256 new tokens (log-uniform)."""
    length = rng.choice(PROMPT_LENGTHS)
    new_tokens = round(MIXED_MIN_NEW * (MIXED_MAX_NEW / MIXED_MIN_NEW) ** rng.random())
    return {"input_ids": [rng.randrange(PROMPT_ID_RANGE) for _ in range(length)], "max_new_tokens": new_tokens}


def default_body(rng: random.Random) -> dict[str, Any]:
    """The climb's default workload: article-mix prompt, 32 new tokens."""
    length = rng.choice(PROMPT_LENGTHS)
    return {"input_ids": [rng.randrange(PROMPT_ID_RANGE) for _ in range(length)], "max_new_tokens": 32}


# shared-prefix: the Locust harness's own definition, so both clients send the same prompts for a seed.
WORKLOADS = {"mixed": mixed_body, "default": default_body, "shared-prefix": HARNESS_WORKLOADS["shared-prefix"].body}

# The chat workload: what a help desk in front of an instruct model sends. Every user's conversation opens
# with the same system prompt (a prefix shared by every request once the template renders it), then one
# short question; the answer ends at the model's end of turn or at CHAT_MAX_TOKENS.
CHAT_SYSTEM_PROMPT = ("You are the help desk of a small public library. Answer the visitor's question in two or three "
                      "plain sentences. If you do not know something about this library, say so and suggest asking "
                      "the staff at the front desk. Never invent opening hours, prices or names.")
CHAT_QUESTIONS = (
    "How do I renew a book?", "Can I borrow a laptop?", "What is an e-book?", "Where can I print a document?",
    "How many books can I borrow at once?", "Do you have books for children?", "What is interlibrary loan?",
    "How do I find a book on the shelves?", "Can I reserve a study room?", "What happens if I return a book late?",
    "Is there free Wi-Fi?", "How do I get a library card?", "Can you recommend a short novel?",
    "What does a librarian do?", "How do I cite a book in an essay?", "Can I donate old books?",
)
CHAT_MAX_TOKENS = 64


def chat_body(rng: random.Random) -> dict[str, Any]:
    """One request of the ``chat`` workload: the shared system prompt and one short question."""
    messages = [{"role": "system", "content": CHAT_SYSTEM_PROMPT}, {"role": "user", "content": rng.choice(CHAT_QUESTIONS)}]
    return {"messages": messages, "max_new_tokens": CHAT_MAX_TOKENS}


# Workloads only OpenAI's routes carry (``/v1/chat/completions``): messages, not ids.
OPENAI_WORKLOADS = {**WORKLOADS, "chat": chat_body}

# The prefix-caching comparison of chapter 8: its labels, the flag each gives the server, where its files go.
PREFIX_CACHING_VARIANTS = {"caching-on": "--prefix-caching=on", "caching-off": "--prefix-caching=off"}
PREFIX_CACHING_DIR = "ch08/prefix-caching"
PREFIX_CACHING_WORKLOADS = ("shared-prefix", "default", "mixed")
# Both variants run the same engine and attention: chapter 8's start-up rules measure and choose both
# (chapter 5's bf16 crossover, flex against gather), and on a noisy machine two servers may choose apart,
# which would be measured as a difference of caching.
PREFIX_CACHING_PINNED = "--precision=fp32 --attention=flex"


def prefix_caching_command(workload: str, results_dir: str = "benchmarks/reference/cpu") -> str:
    """The command that records chapter 8 with prefix caching on and off on ``workload`` (one file)."""
    variants = " ".join(f"--variant {label}=ch08:{flag}" for label, flag in PREFIX_CACHING_VARIANTS.items())
    return (f"python -m benchmarks.harness.streaming compare --profile cpu {variants} --server-args {shlex.quote(PREFIX_CACHING_PINNED)} "
            f"--workload {workload} --users 32 "
            f"--duration-s 20 --rounds 3 --out {results_dir}/{PREFIX_CACHING_DIR}/{workload}.json")


@dataclass(frozen=True)
class Variant:
    """One server ``compare`` measures: ``chapter`` started with ``flags`` of its own, reported under ``label``."""

    label: str
    chapter: str
    flags: tuple[str, ...] = ()

    @property
    def streams(self) -> bool:
        return self.chapter == "ch08"


def parse_variant(text: str) -> Variant:
    """``LABEL=CHAPTER[:FLAGS]`` -> a :class:`Variant` (``caching-off=ch08:--prefix-caching=off``; FLAGS split as a
    shell would, so ``"x=ch08:--a 1 --b 2"`` works quoted). Raises ``argparse.ArgumentTypeError`` when malformed."""
    label, equals, rest = text.partition("=")
    chapter, _, flags = rest.partition(":")
    if not equals or not re.fullmatch(r"[A-Za-z0-9_.\-]+", label) or not re.fullmatch(r"ch\d\d", chapter):
        raise argparse.ArgumentTypeError(f"{text!r}: expected LABEL=CHAPTER[:FLAGS], e.g. caching-off=ch08:--prefix-caching=off")
    try:
        return Variant(label, chapter, tuple(shlex.split(flags)))
    except ValueError as error:  # an unbalanced quote
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None


def planned_variants(chapters: list[str] | None, variants: list[Variant]) -> list[Variant]:
    """The servers ``compare`` runs, in order: each of ``chapters`` at its defaults, then ``variants``;
    ch06 and ch08 when neither is given. Raises ValueError when two share a label."""
    plan = [Variant(chapter, chapter) for chapter in (chapters or ([] if variants else ["ch06", "ch08"]))] + variants
    labels = [variant.label for variant in plan]
    if duplicates := sorted({label for label in labels if labels.count(label) > 1}):
        raise ValueError(f"every server compared needs its own label; repeated: {', '.join(duplicates)}")
    return plan


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A server's figures over ``rounds`` (each a :func:`summarize`): the round of median QPS (the lower
    middle one for an even count), plus every round under ``rounds`` when there were several."""
    if len(rounds) == 1:
        return rounds[0]
    kept = sorted(rounds, key=lambda run: run["qps"])[(len(rounds) - 1) // 2]
    return {**kept, "rounds": rounds}


@dataclass
class RequestRecord:
    sent: float
    status: int
    token_times: list[float] = field(default_factory=list)  # arrival time of each token (s, same clock as sent)
    ended: float = 0.0
    output_tokens: int = 0
    requested_tokens: int | None = None  # what an OpenAI-route request asked for (None on /v1/inference)
    reconnects: int = 0  # sent again on a new connection after the server closed a kept-alive one unanswered

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.output_tokens > 0

    @property
    def ttft(self) -> float:
        return (self.token_times[0] if self.token_times else self.ended) - self.sent

    @property
    def e2e(self) -> float:
        return self.ended - self.sent

    @property
    def tpot(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


async def _one_request(session: aiohttp.ClientSession, url: str, body: dict, stream: bool) -> RequestRecord:
    record = RequestRecord(sent=time.perf_counter(), status=0)
    try:
        if stream:
            async with session.post(url, json={**body, "stream": True}) as response:
                record.status = response.status
                async for line in response.content:  # one server-sent-event line at a time
                    if line.startswith(b"event: token"):
                        record.token_times.append(time.perf_counter())
                    elif line.startswith(b"event: error"):
                        record.status = 500
            record.output_tokens = len(record.token_times)
        else:
            async with session.post(url, json=body) as response:
                record.status = response.status
                if response.status == 200:
                    record.output_tokens = len((await response.json())["output_ids"])
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):  # ValueError: a line past aiohttp's limit
        record.status = -1
    record.ended = time.perf_counter()
    return record


def openai_body(body: dict[str, Any], model: str, stream: bool, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A workload's body as an OpenAI request: the same prompt ids (or messages, for ``/v1/chat/completions``) and
    new tokens, greedy; a streamed one asks for ``usage`` in its last chunk; ``extra`` (a server's own fields) last."""
    prompt = {"messages": body["messages"]} if "messages" in body else {"prompt": body["input_ids"]}
    request = {"model": model, **prompt, "max_tokens": body["max_new_tokens"], "temperature": 0.0}
    if stream:
        request.update(stream=True, stream_options={"include_usage": True})
    return {**request, **(extra or {})}


async def served_model(session: aiohttp.ClientSession, url: str) -> str:
    """The first model ``GET /v1/models`` lists: the name an OpenAI-route request must give."""
    async with session.get(f"{url.rstrip('/')}/v1/models") as response:
        response.raise_for_status()
        return (await response.json())["data"][0]["id"]


async def _one_openai_request(session: aiohttp.ClientSession, url: str, body: dict, stream: bool) -> RequestRecord:
    """One request to ``/v1/completions`` or ``/v1/chat/completions``. Streamed: every chunk with a choice is a
    token's arrival (on the chat route, one whose delta carries text: the first chunk names only the role), and
    the last chunk's ``usage`` is the count; a server that closes with a chunk of its own after the last token
    (chapter 8 sends ``finish_reason`` apart) has that chunk dropped, as it carries no token.

    A kept-alive connection the server had already closed (llama-server closes them on its own schedule)
    fails before any answer: the request is sent once more on a connection of its own, as HTTP clients do,
    and counted in ``reconnects``; a failure once an answer started is an error."""
    record = RequestRecord(sent=time.perf_counter(), status=0, requested_tokens=body["max_tokens"])
    try:
        try:
            await _post_openai(session, url, body, record, stream)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):  # closed before a reply, or while the body went
            if record.status != 0:
                raise
            record.reconnects += 1
            async with aiohttp.ClientSession(timeout=session.timeout) as fresh:  # a new connection: the pool may hold more stale ones
                await _post_openai(fresh, url, body, record, stream)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError):  # ValueError: a line past aiohttp's limit, or not JSON
        record.status = -1
    record.ended = time.perf_counter()
    return record


async def _post_openai(session: aiohttp.ClientSession, url: str, body: dict, record: RequestRecord, stream: bool) -> None:
    async with session.post(url, json=body) as response:
        record.status = response.status
        await _read_openai_answer(response, record, stream)


async def _read_openai_answer(response: aiohttp.ClientResponse, record: RequestRecord, stream: bool) -> None:
    """``record``'s tokens (their arrival times, streamed) and its count, from an OpenAI-route answer."""
    if not stream or response.status != 200:
        if response.status == 200:
            record.output_tokens = (await response.json())["usage"]["completion_tokens"]
        return
    counted = None
    async for line in response.content:  # one server-sent-event line at a time
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            record.status = 500
        if chunk.get("choices") and chunk["choices"][0].get("delta", {"content": True}).get("content"):
            record.token_times.append(time.perf_counter())
        if chunk.get("usage"):
            counted = chunk["usage"]["completion_tokens"]
    record.output_tokens = len(record.token_times) if counted is None else counted
    del record.token_times[record.output_tokens:]


async def run_closed_loop(url: str, users: int, duration_s: float, workload: str, stream: bool, seed: int = 1234,
                          request_timeout_s: float = 120.0, api: str = "inference",
                          openai_extra: dict[str, Any] | None = None) -> tuple[list[RequestRecord], float]:
    """``users`` clients in a loop for ``duration_s``; returns every record and the measured window (s).

    ``api``: ``inference`` (the contract's ``/v1/inference``) or ``openai`` (``/v1/completions``, or
    ``/v1/chat/completions`` for the ``chat`` workload, the model named by ``GET /v1/models``, asked before the
    window opens; ``openai_extra`` added to every request body)."""
    records: list[RequestRecord] = []
    if api not in ("inference", "openai"):
        raise ValueError(f"api {api!r}: expected inference or openai")
    if workload not in (OPENAI_WORKLOADS if api == "openai" else WORKLOADS):
        raise ValueError(f"workload {workload!r} is not sent on api {api!r}")
    make_body = OPENAI_WORKLOADS[workload]
    connector = aiohttp.TCPConnector(limit=users)  # a kept-alive connection per user
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if api == "openai":
            model = await served_model(session, url)
            endpoint = f"{url.rstrip('/')}/v1/{'chat/completions' if workload == 'chat' else 'completions'}"

            async def send(body: dict) -> RequestRecord:
                return await _one_openai_request(session, endpoint, openai_body(body, model, stream, openai_extra), stream)
        else:
            endpoint = f"{url.rstrip('/')}/v1/inference"

            async def send(body: dict) -> RequestRecord:
                return await _one_request(session, endpoint, body, stream)

        started = time.perf_counter()
        stop_at = started + duration_s

        async def user(index: int) -> None:
            rng = random.Random(seed * 1_000_003 + index)
            while time.perf_counter() < stop_at:
                records.append(await send(make_body(rng)))

        await asyncio.gather(*(user(i) for i in range(users)))
    return records, time.perf_counter() - started


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {"mean": statistics.fmean(ordered) * 1e3, "p50": statistics.median(ordered) * 1e3, "p99": p99 * 1e3}


def summarize(records: list[RequestRecord], window_s: float, slo_ttft_ms: float | None, slo_tpot_ms: float | None,
              slo_e2e_ms: float | None) -> dict[str, Any]:
    """Throughput, the four latencies (milliseconds: mean, p50, p99) and goodput at the SLOs given."""
    ok = [r for r in records if r.ok]

    def meets_slo(r: RequestRecord) -> bool:
        tpot = r.tpot
        return ((slo_ttft_ms is None or r.ttft * 1e3 <= slo_ttft_ms)
                and (slo_tpot_ms is None or tpot is None or tpot * 1e3 <= slo_tpot_ms)
                and (slo_e2e_ms is None or r.e2e * 1e3 <= slo_e2e_ms))

    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[str(r.status)] = errors.get(str(r.status), 0) + 1
    streamed = any(r.token_times for r in ok)
    # An OpenAI-route answer may end early (a server that stops at end-of-text): counted, as the work differs.
    asked = [r for r in ok if r.requested_tokens is not None]
    short = {"short_answers": sum(1 for r in asked if r.output_tokens < r.requested_tokens)} if asked else {}
    reconnects = {"reconnects": n} if (n := sum(r.reconnects for r in records)) else {}
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": errors,
        "window_s": round(window_s, 3),
        "qps": len(ok) / window_s,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / window_s,
        "ttft_ms": _percentiles([r.ttft for r in ok]),
        "tpot_ms": _percentiles([t for r in ok if (t := r.tpot) is not None]) if streamed else None,
        "itl_ms": _percentiles([gap for r in ok for gap in r.itls()]) if streamed else None,
        "e2e_ms": _percentiles([r.e2e for r in ok]),
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms, "e2e_ms": slo_e2e_ms},
        "goodput_qps": sum(1 for r in ok if meets_slo(r)) / window_s,
        **short,
        **reconnects,
    }


def compare_document(workload: str, users: int, duration_s: float, chapters: dict[str, dict[str, Any]],
                     command: str, server_args: str = "", harness: dict[str, Any] | None = None,
                     variants: list[Variant] | None = None, rounds: int = 1) -> dict[str, Any]:
    """The JSON ``compare`` writes: each server's :func:`summarize` (plus ``streamed``) at the same load,
    keyed by its label (a chapter's id unless it is a ``--variant``), its :func:`median_round` when ``rounds`` > 1.

    ``harness``: how the servers ran (:func:`harness_settings`; :func:`unpinned_harness` when not given).
    ``variants``: each label's chapter and own flags; ``rounds``: how many times each server ran."""
    document = {"kind": "streaming-compare", "schema": 1, "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "command": command, "workload": workload, "users": users, "duration_s": duration_s,
                "server_args": server_args, "harness": harness or unpinned_harness(), "rounds": rounds, "chapters": chapters}
    if variants is not None:
        document["variants"] = {v.label: {"chapter": v.chapter, "flags": shlex.join(v.flags)} for v in variants}
    return document


def unpinned_harness() -> dict[str, Any]:
    """The ``harness`` block of ``compare`` without ``--profile``: every server at its defaults, nothing pinned."""
    return {"profile": None, "pinning": False, "server_cores": None, "client_cores": None, "server_env": {},
            "git_commit": None}


_CORE_PLANS: dict[str, tuple[list[int] | None, list[int] | None]] = {}  # profile -> (server, client) cores, this process's


def harness_settings(profile_name: str | None, weights: str | None = None) -> tuple[dict[str, Any], list[str], dict[str, str]]:
    """``(the document's harness block, flags for every server, environment for every server)`` for a profile
    (serving ``weights`` where given, as :func:`benchmarks.harness.profiles.with_weights` says).

    With a profile: its model flags, torch threads and thread variables, and its core plan (the client
    pins itself to the load generator's cores here). Without one: nothing added, nothing pinned.
    """
    if profile_name is None:
        return unpinned_harness(), [], {}
    import os

    from benchmarks.harness.environment import cpu_description, git_state
    from benchmarks.harness.profiles import get_profile

    profile = get_profile(profile_name, weights)
    # Planned once per process: once this client has pinned itself, its own affinity (which the plan
    # reads) is the load generator's core alone, and a second plan would pin no server at all.
    if profile.name not in _CORE_PLANS:
        _CORE_PLANS[profile.name] = profile.core_plan()
    server_cores, client_cores = _CORE_PLANS[profile.name]
    if client_cores:
        os.sched_setaffinity(0, set(client_cores))
    commit, dirty = git_state()
    harness = {"profile": profile.name, "pinning": bool(server_cores), "server_cores": server_cores,
               "client_cores": client_cores, "server_env": profile.server_env(), "git_commit": commit, "git_dirty": dirty,
               "cpu": cpu_description()}
    return harness, profile.server_args(), profile.server_env()


def describe_harness(harness: dict[str, Any] | None) -> str:
    """One sentence on how a comparison ran, for the tables that quote it (``None``: :func:`unpinned_harness`;
    the CPU named where the block records it)."""
    harness = harness or unpinned_harness()
    if not harness.get("profile"):
        return "every server at its own defaults; client and server unpinned, sharing every core"
    where = (f"server pinned to cores {harness['server_cores']}, client to {harness['client_cores']}" if harness["pinning"]
             else "no core pinning (fewer than two cores)")
    machine = f"; CPU: {harness['cpu']}" if harness.get("cpu") else ""
    return f"the climb's `{harness['profile']}` profile settings for every server; {where}{machine}"


def _run(args: argparse.Namespace, url: str, stream: bool) -> dict[str, Any]:
    api = {"api": getattr(args, "api", "inference"), "openai_extra": getattr(args, "openai_extra", None)}
    # A short warm-up (first allocations, lazy kernels) that is not measured.
    asyncio.run(run_closed_loop(url, min(args.users, 4), min(2.0, args.duration_s), args.workload, stream, seed=args.seed + 1, **api))
    records, window = asyncio.run(run_closed_loop(url, args.users, args.duration_s, args.workload, stream, seed=args.seed, **api))
    return summarize(records, window, args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)


def json_object(text: str) -> dict[str, Any]:
    """``--openai-extra``'s value: a JSON object, else ``argparse.ArgumentTypeError``."""
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: not JSON ({error})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``run`` (one server at ``--url``) and ``compare`` (chapters started in turn)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.harness.streaming", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "compare"):
        p = sub.add_parser(name)
        p.add_argument("--users", type=int, default=32)
        p.add_argument("--duration-s", type=float, default=20.0)
        p.add_argument("--workload", choices=sorted(WORKLOADS), default="mixed")
        p.add_argument("--seed", type=int, default=1234)
        p.add_argument("--slo-ttft-ms", type=float, default=None)
        p.add_argument("--slo-tpot-ms", type=float, default=None)
        p.add_argument("--slo-e2e-ms", type=float, default=None)
        p.add_argument("--out", type=Path, default=None, help="write the JSON here as well")
    run = sub.choices["run"]
    run.add_argument("--url", required=True, help="a server on loopback, e.g. http://127.0.0.1:8000")
    run.add_argument("--no-stream", action="store_true", help="the server does not stream: time whole responses")
    run.add_argument("--api", choices=("inference", "openai"), default="inference",
                     help="the contract's /v1/inference, or OpenAI's /v1/completions (chapter 8, vLLM)")
    run.add_argument("--openai-extra", type=json_object, default=None, metavar="JSON",
                     help='fields added to every OpenAI-route request, e.g. \'{"ignore_eos": true}\' for vLLM')
    compare = sub.choices["compare"]
    compare.add_argument("--chapters", nargs="+", default=None, help="chapters at their defaults (ch06 ch08 when no --variant)")
    compare.add_argument("--variant", type=parse_variant, action="append", default=[], metavar="LABEL=CHAPTER[:FLAGS]",
                         help="a chapter with flags of its own, e.g. caching-off=ch08:--prefix-caching=off (repeatable)")
    compare.add_argument("--no-stream", action="store_true",
                         help="ask every server for whole answers, chapter 8 too (what streaming each token costs it)")
    compare.add_argument("--rounds", type=int, default=1, help="run every server this many times, round by round (reversed every other round)")
    compare.add_argument("--server-args", default="", help="extra flags for every server")
    compare.add_argument("--profile", choices=("cpu",), default=None,
                         help="run every server as the climb's profile does (flags, threads, pinned cores)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.users < 1 or args.duration_s <= 0 or getattr(args, "rounds", 1) < 1:
        parser.error("--users and --rounds must be at least 1 and --duration-s positive")

    if args.command == "run":
        if not args.url.startswith(("http://127.0.0.1", "http://localhost", "http://[::1]")):
            parser.error("--url must be on loopback")
        result: dict[str, Any] = {"url": args.url, "workload": args.workload, "users": args.users, "api": args.api,
                                  **_run(args, args.url, not args.no_stream)}
    else:
        from benchmarks.harness.server_process import running_module
        from chapters import module_for

        try:
            plan = planned_variants(args.chapters, args.variant)
            modules = {variant.label: module_for(variant.chapter) for variant in plan}
        except (KeyError, ValueError) as error:
            parser.error(error.args[0])
        harness, profile_args, server_env = harness_settings(args.profile)
        result = compare_document(args.workload, args.users, args.duration_s, {}, "python -m benchmarks.harness.streaming " + shlex.join(argv),
                                  args.server_args, harness, plan, args.rounds)
        runs: dict[str, list[dict[str, Any]]] = {variant.label: [] for variant in plan}
        for index in range(args.rounds):  # every server once per round, so slow drift of a shared machine hits them all
            # and in reverse order every other round, so that going first or last is not one server's lot
            for variant in plan if index % 2 == 0 else plan[::-1]:
                flags = [*profile_args, *args.server_args.split(), *variant.flags]
                with running_module(modules[variant.label], flags, name=variant.label, env=server_env,
                                    cpu_cores=harness["server_cores"]) as server:
                    stream = variant.streams and not args.no_stream
                    record = {"streamed": stream, **_run(args, server.url, stream)}
                    record.update(server_choices(server.url))
                    runs[variant.label].append(record)
        result["chapters"] = {label: median_round(rounds) for label, rounds in runs.items()}
    print_and_save(result, args.out)


if __name__ == "__main__":
    main()
