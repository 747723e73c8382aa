"""Scaling past this machine, in simulation: 1 to 64 replicas of chapter 8's batcher behind a router.

Two cores cannot show what 64 replicas do, so this module simulates them: a discrete-event model
of chapter 8's step loop, one per replica, fed by Poisson arrivals through one of three routers,
with each step's duration taken from chapter 8's engine as measured on this machine.

    python -m chapters.ch09_scale_out.simulation measure --out benchmarks/reference/cpu/ch09/step-times.json
    python -m chapters.ch09_scale_out.simulation run --out benchmarks/reference/cpu/ch09/simulation.json

``measure`` times chapter 8's real engine step in-process (the server's own ``build_backend``, its
default settings, one torch thread): decode steps of 1 to ``max_num_seqs`` rows at two history
lengths, and steps that also prefill a prompt, and writes the medians with the fitted step-time
model (:class:`StepTimeModel`). ``run`` reads that file and sweeps routers x replicas x
utilisations x request mixes; the JSON carries the assumptions as sentences (:func:`assumptions`).

One replica is chapter 8's :class:`~chapters.ch08_continuous_batching.scheduler.ContinuousScheduler`
reduced to its arithmetic (:func:`simulate`): every step, each running sequence whose prompt is
computed decodes one token; sequences still prefilling continue within the token budget; waiting
sequences are admitted first come first served while fewer than ``max_num_seqs`` run and budget is
left (a prompt longer than the budget left is chunked). A prompt's last chunk yields the first
token; a sequence leaves at the end of the step that made its last token. The routers:

- ``random``: a replica drawn uniformly;
- ``pow2``: of two distinct replicas drawn at random, the one with fewer requests in flight (Ray
  Serve's default router, the one chapter 9 deploys); a tie goes to the first drawn;
- ``least-tokens``: chapter 9's router (:mod:`~chapters.ch09_scale_out.routing`): the replica owing
  the fewest tokens by the ledger a proxy can keep, which sees requests leave but not their
  progress: each request counts its whole ``prompt + max_new_tokens`` until it finishes;
- ``least-remaining``: what a router would do with the replicas' own progress reported to it (the
  signal engines such as vLLM export): the replica with the fewest tokens still to compute, for each
  request prompt tokens not yet prefilled plus ``max_new_tokens`` minus the tokens generated so far.

Both know what a request asks for, not how long its answer will be: where answers stop before
``max_new_tokens`` (the ``mixed-capped`` mix), they over-count them.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import platform
import random
import subprocess
import sys
import time
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

ROUTERS: tuple[str, ...] = ("random", "pow2", "least-tokens", "least-remaining")
REPLICA_COUNTS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
# Offered load as a fraction of what the replicas can serve; the article's lesson sits at 0.85.
UTILISATIONS: tuple[float, ...] = (0.5, 0.7, 0.85, 0.95)

# Chapter 8's scheduler defaults (chapters/ch08_continuous_batching/server.py, SchedulerOptions) and
# chapter 4's queue bound (max_queue): a replica holds at most max_num_seqs + max_queue requests,
# which is what chapter 9 gives Serve as max_ongoing_requests.
MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 512
MAX_QUEUE = 100

# The SLO of chapter 8's streaming comparison (its README: --slo-ttft-ms 1000 --slo-tpot-ms 100):
# a request counts toward goodput when its first token came within TTFT and its later tokens,
# on average, within TPOT each (vLLM's goodput definition).
SLO_TTFT_MS = 1000.0
SLO_TPOT_MS = 100.0

# The request mixes, as the benchmarks define them. Chapters may not import benchmarks (packages
# depend one way), so they are repeated here and tests/test_ch09_simulation.py holds them equal to
# benchmarks/workload.py (PROMPT_LENGTHS, the default workload's 32 new tokens) and
# benchmarks/streaming.py (the mixed workload's 8..256 new tokens, log-uniform).
ARTICLE_PROMPT_LENGTHS: tuple[int, ...] = (16, 32, 64, 128)
DEFAULT_NEW_TOKENS = 32
MIXED_NEW_TOKENS: tuple[int, int] = (8, 256)

DEFAULT_SEED = 1234
DEFAULT_STEP_TIMES = Path("benchmarks/reference/cpu/ch09/step-times.json")
DEFAULT_OUT = Path("benchmarks/reference/cpu/ch09/simulation.json")
OPEN_LOOP_REFERENCE = Path("benchmarks/reference/cpu/openloop/ch08.json")
REPO_ROOT = Path(__file__).resolve().parents[2]

# Requests measured: those arriving between these fractions of the arrival span. The first 10 %
# fill the empty replicas (a start-up transient); after the last 10 % the arrivals stop and the
# queues drain faster than in steady state.
MEASURED_WINDOW: tuple[float, float] = (0.1, 0.9)
# ... and no request before WARMUP_S: a 256-token answer takes seconds, and 64 replicas take that
# long to fill however many requests the first 10 % are. Each point simulates at least
# MIN_REQUESTS requests (for its P99) and MIN_DURATION_S seconds of arrivals (for a steady state
# past the warm-up). Both seconds are for the mixed workload's 256-token answers; simulated_seconds
# shortens them for a mix of shorter answers.
WARMUP_S = 8.0
MIN_REQUESTS = 8_000
MIN_DURATION_S = 30.0


# ------------------------------------------------------------------------------------------------
# Request mixes
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestMix:
    """Prompt and answer lengths of a stream of requests.

    Prompt lengths are drawn uniformly from ``prompt_lengths``. The answer length (tokens the model
    really generates) is drawn from ``answer_lengths`` (with ``answer_weights``, uniform when empty)
    or, when ``log_uniform_answers`` is set, log-uniformly between its bounds and rounded, as
    ``benchmarks/streaming.py`` draws the ``mixed`` workload. ``max_new_tokens`` is what each
    request asks for: ``None`` means exactly its answer length (chapter 8 generates exactly
    ``max_new_tokens``; the benchmarks' answers never stop early), a number means every request
    asks that many and stops at its answer length (an end-of-text token the router cannot foresee).
    """

    name: str
    description: str
    prompt_lengths: tuple[int, ...] = ARTICLE_PROMPT_LENGTHS
    answer_lengths: tuple[int, ...] = ()
    answer_weights: tuple[float, ...] = ()
    log_uniform_answers: tuple[int, int] | None = None
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        if bool(self.answer_lengths) == (self.log_uniform_answers is not None):
            raise ValueError("give exactly one of answer_lengths and log_uniform_answers")
        if self.answer_weights and len(self.answer_weights) != len(self.answer_lengths):
            raise ValueError("answer_weights needs one weight per answer length")
        longest_answer = max(self.answer_lengths) if self.answer_lengths else self.log_uniform_answers[1]
        if self.max_new_tokens is not None and self.max_new_tokens < longest_answer:
            raise ValueError(f"max_new_tokens {self.max_new_tokens} is below the longest answer {longest_answer}")
        if min(self.prompt_lengths) < 1 or (self.answer_lengths and min(self.answer_lengths) < 1):
            raise ValueError("prompts and answers need at least one token")

    def draw(self, rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(prompt tokens, answer tokens, max_new_tokens)`` of ``count`` requests, as int64 arrays."""
        prompts = rng.choice(np.asarray(self.prompt_lengths, dtype=np.int64), size=count)
        if self.log_uniform_answers is not None:
            low, high = self.log_uniform_answers
            answers = np.rint(low * (high / low) ** rng.random(count)).astype(np.int64)
        else:
            weights = np.asarray(self.answer_weights, dtype=float) if self.answer_weights else None
            answers = rng.choice(np.asarray(self.answer_lengths, dtype=np.int64), size=count,
                                 p=None if weights is None else weights / weights.sum())
        max_new = answers.copy() if self.max_new_tokens is None else np.full(count, self.max_new_tokens, dtype=np.int64)
        return prompts, answers, max_new


def simulated_seconds(mix: RequestMix) -> tuple[float, float]:
    """``(warm-up, minimum seconds of arrivals)`` for ``mix``.

    ``WARMUP_S`` and ``MIN_DURATION_S`` are set for answers of up to 256 tokens (the mixed
    workload); replicas fill and settle sooner when the longest answer is shorter, in proportion,
    down to a third of them.
    """
    longest = max(mix.answer_lengths) if mix.answer_lengths else mix.log_uniform_answers[1]
    scale = min(1.0, max(longest / MIXED_NEW_TOKENS[1], 1 / 3))
    return WARMUP_S * scale, MIN_DURATION_S * scale


MIXES: dict[str, RequestMix] = {
    "mixed": RequestMix(
        "mixed", "the article's prompts (16/32/64/128 tokens, uniform), answers of 8 to 256 tokens "
        "(log-uniform, rounded), each request asking exactly its answer's length: benchmarks/streaming.py's mixed workload",
        log_uniform_answers=MIXED_NEW_TOKENS),
    "mixed-capped": RequestMix(
        "mixed-capped", "the mixed workload's prompts and answers, but every request asks for 256 new tokens "
        "and stops at its answer's length, as a chat client that leaves max_tokens at a cap: the router "
        "cannot tell a short answer from a long one",
        log_uniform_answers=MIXED_NEW_TOKENS, max_new_tokens=MIXED_NEW_TOKENS[1]),
    "default": RequestMix(
        "default", "the climb's workload: the article's prompts, 32 new tokens each (benchmarks/workload.py)",
        answer_lengths=(DEFAULT_NEW_TOKENS,)),
}


# ------------------------------------------------------------------------------------------------
# Step time
# ------------------------------------------------------------------------------------------------


STEP_TIME_FORMULA = (
    "step_ms = step_intercept_ms + ms_per_decode_row x decode rows + ms_per_context_token x positions the decode rows "
    "attend to, + prefill_intercept_ms + prefill_ms_per_token x prompt tokens when the step also prefills; a step "
    "without decode rows: prefill_only_intercept_ms + prefill_only_ms_per_token x prompt tokens"
)


@dataclass(frozen=True)
class StepTimeModel:
    """The duration of one step of chapter 8's engine, from what the step computes.

    A step with ``d >= 1`` decode rows that attend to ``context`` positions in all (each row: its
    prompt plus the tokens it has so far) and ``p`` prompt tokens takes, in milliseconds::

        step_intercept_ms + ms_per_decode_row * d + ms_per_context_token * context
            + (prefill_intercept_ms + prefill_ms_per_token * p   if p > 0)

    and a step with no decode rows ``prefill_only_intercept_ms + prefill_only_ms_per_token * p``:
    a fixed cost per step (the scheduler, the runner, the kernels' launches), a cost per row (the
    weights' matrix products), a cost per position read (attention over the paged cache) and a cost
    per prompt token. Durations never go below ``floor_ms``.
    """

    step_intercept_ms: float
    ms_per_decode_row: float
    ms_per_context_token: float
    prefill_intercept_ms: float
    prefill_ms_per_token: float
    prefill_only_intercept_ms: float
    prefill_only_ms_per_token: float
    floor_ms: float = 0.05

    @classmethod
    def constant(cls, step_ms: float) -> StepTimeModel:
        """Every step takes ``step_ms``, whatever it computes (the tests' oracle model)."""
        return cls(step_ms, 0.0, 0.0, 0.0, 0.0, step_ms, 0.0)

    @classmethod
    def from_file(cls, path: Path) -> StepTimeModel:
        """The model a ``measure`` run wrote (its ``model`` block)."""
        return cls(**json.loads(Path(path).read_text())["model"])

    def step_ms(self, decode_rows: int, prefill_tokens: int, context: float) -> float:
        """Milliseconds of one step (the formula in the class docstring)."""
        if decode_rows == 0:
            ms = self.prefill_only_intercept_ms + self.prefill_only_ms_per_token * prefill_tokens
        else:
            ms = self.step_intercept_ms + self.ms_per_decode_row * decode_rows + self.ms_per_context_token * context
            if prefill_tokens:
                ms += self.prefill_intercept_ms + self.prefill_ms_per_token * prefill_tokens
        return max(ms, self.floor_ms)

    def describe(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------------------
# The simulation
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaConfig:
    """What each replica runs: chapter 8's scheduler budgets and its step time."""

    step_model: StepTimeModel
    max_num_seqs: int = MAX_NUM_SEQS
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("need max_num_seqs >= 1 and max_num_batched_tokens >= max_num_seqs (chapter 8's rule)")


@dataclass
class Requests:
    """A stream of requests: arrival time (s), prompt tokens, answer tokens, max_new_tokens; equally long."""

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    answer_tokens: np.ndarray
    max_new_tokens: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if not (len(self.prompt_tokens) == len(self.answer_tokens) == len(self.max_new_tokens) == n):
            raise ValueError("every array needs one entry per request")
        if n and (np.any(np.diff(self.arrival_s) < 0) or np.any(self.answer_tokens < 1) or np.any(self.prompt_tokens < 1)
                  or np.any(self.max_new_tokens < self.answer_tokens)):
            raise ValueError("arrivals must be sorted; prompts and answers >= 1 token; max_new_tokens >= the answer")

    def __len__(self) -> int:
        return len(self.arrival_s)

    @classmethod
    def poisson(cls, mix: RequestMix, rate_per_s: float, count: int, rng: np.random.Generator) -> Requests:
        """``count`` requests of ``mix`` arriving as a Poisson process of ``rate_per_s``, from time 0."""
        arrivals = np.cumsum(rng.exponential(1.0 / rate_per_s, size=count))
        return cls(arrivals, *mix.draw(rng, count))


@dataclass
class Outcome:
    """What happened to every request (times in seconds; NaN never stays: every request finishes) and to every replica."""

    requests: Requests
    replica: np.ndarray  # the replica each request was routed to
    started_s: np.ndarray  # first step that computed any of it (it left the queue)
    first_token_s: np.ndarray
    finished_s: np.ndarray
    in_flight_at_arrival: np.ndarray  # the chosen replica's requests in flight when this one arrived
    replica_busy_s: np.ndarray  # per replica: time spent stepping inside the window
    replica_running_s: np.ndarray  # per replica: integral of running sequences over time inside the window
    replica_finished: np.ndarray  # per replica: requests finished (all of them)
    final_in_flight: np.ndarray  # per replica, after the run: what the routers' counters came back to
    final_tokens_left: np.ndarray
    final_budget_left: np.ndarray
    steps: int
    window_s: tuple[float, float]


# A router is made per run: ``factory(replicas, rng, requests)`` returns ``choose(request index, requests in flight
# per replica, tokens per replica) -> replica``; its random draws are made up front, so a run is one seed. The tokens
# are those still to compute, or for least-tokens the ledger of budgets (see ROUTER_LEDGERS).
Router = Callable[[int, list[int], list[int]], int]


def route_random(n_replicas: int, rng: np.random.Generator, count: int) -> Router:
    """A replica drawn uniformly, whatever the replicas hold."""
    draws = rng.integers(n_replicas, size=count).tolist()
    return lambda index, in_flight, tokens_left: draws[index]


def route_pow2(n_replicas: int, rng: np.random.Generator, count: int) -> Router:
    """Serve's power of two choices: two distinct replicas drawn, the one with fewer requests in flight (a tie: the first)."""
    if n_replicas == 1:
        return lambda index, in_flight, tokens_left: 0
    first = rng.integers(n_replicas, size=count)
    second = (first + 1 + rng.integers(n_replicas - 1, size=count)) % n_replicas  # distinct from the first
    firsts, seconds = first.tolist(), second.tolist()

    def choose(index: int, in_flight: list[int], tokens_left: list[int]) -> int:
        a, b = firsts[index], seconds[index]
        return b if in_flight[b] < in_flight[a] else a

    return choose


def route_least_tokens(n_replicas: int, rng: np.random.Generator, count: int) -> Router:
    """The replica with the fewest tokens still to compute (prompt not yet prefilled + max_new_tokens - generated)."""
    # Ties (idle replicas, most of all) go to the first tied replica at or after a random offset,
    # so that they spread instead of all landing on replica 0.
    offsets = rng.integers(n_replicas, size=count).tolist()

    def choose(index: int, in_flight: list[int], tokens_left: list[int]) -> int:
        fewest = min(tokens_left)
        try:
            return tokens_left.index(fewest, offsets[index])
        except ValueError:
            return tokens_left.index(fewest)

    return choose


ROUTER_FACTORIES: dict[str, Callable[[int, np.random.Generator, int], Router]] = {
    "random": route_random, "pow2": route_pow2, "least-tokens": route_least_tokens,
    "least-remaining": route_least_tokens,  # the same choice, over the tokens still to compute (ROUTER_LEDGERS)
}
# Which count of tokens a router is handed: those still to compute (prefill and decode progress
# subtracted step by step), or each request's whole budget, prompt + max_new_tokens, until it
# finishes (what a proxy that sees requests leave but not their progress can count).
ROUTER_LEDGERS: dict[str, str] = {"least-tokens": "budget"}


class _Replica:
    """One replica's scheduler state (chapter 8's ContinuousScheduler, reduced to counts and lengths)."""

    __slots__ = ("waiting", "prefilling", "decoding", "context", "finish_at", "step", "running",
                 "stepping", "plan_decodes", "plan_chunks", "plan_prefill_tokens", "step_started", "busy_s", "running_s",
                 "finished")

    def __init__(self) -> None:
        self.waiting: deque[int] = deque()
        self.prefilling: list[list[int]] = []  # [request, prompt tokens not yet computed], in admission order
        self.decoding = 0  # sequences whose prompt is computed: one decode row each per step
        self.context = 0  # positions the decode rows attend to, summed (each row: prompt + tokens so far)
        self.finish_at: dict[int, list[int]] = {}  # step index -> requests whose last token that step makes
        self.step = 0
        self.running = 0  # prefilling + decoding (chapter 8's `running`, bounded by max_num_seqs)
        self.stepping = False  # a step is under way: arrivals wait for its end
        self.plan_decodes = 0
        self.plan_chunks: list[tuple[list[int], int]] = []
        self.plan_prefill_tokens = 0
        self.step_started = 0.0
        self.busy_s = 0.0
        self.running_s = 0.0
        self.finished = 0


def simulate(requests: Requests, router: str, n_replicas: int, config: ReplicaConfig, seed: int = DEFAULT_SEED,
             window: tuple[float, float] | None = None) -> Outcome:
    """Run ``requests`` through ``n_replicas`` replicas behind ``router`` until every request has finished.

    Deterministic for a given ``seed`` (the router's draws). A replica plans a step (see the module
    docstring) when it is idle and a request arrives, or when its previous step ends and it still
    has work; requests that arrive during a step join its queue and are considered at the next
    plan. Routers read the replicas' counters as they were at the end of each replica's last step.
    ``window``, in seconds, bounds where busy time and occupancy are counted (default: the whole run).
    """
    if router not in ROUTER_FACTORIES:
        raise ValueError(f"unknown router {router!r}; known: {', '.join(ROUTER_FACTORIES)}")
    if n_replicas < 1:
        raise ValueError("need at least one replica")
    count = len(requests)
    choose = ROUTER_FACTORIES[router](n_replicas, np.random.default_rng(seed), count)
    arrivals = requests.arrival_s.tolist()
    prompts = requests.prompt_tokens.tolist()
    answers = requests.answer_tokens.tolist()
    max_new = requests.max_new_tokens.tolist()
    model = config.step_model
    max_seqs, budget_per_step = config.max_num_seqs, config.max_num_batched_tokens
    # StepTimeModel.step_ms, inlined: it runs once per simulated step.
    step_intercept, per_row, per_context = model.step_intercept_ms, model.ms_per_decode_row, model.ms_per_context_token
    prefill_intercept, prefill_per_token = model.prefill_intercept_ms, model.prefill_ms_per_token
    only_intercept, only_per_token, floor_ms = model.prefill_only_intercept_ms, model.prefill_only_ms_per_token, model.floor_ms
    window_start, window_end = window if window is not None else (0.0, math.inf)

    replicas = [_Replica() for _ in range(n_replicas)]
    in_flight = [0] * n_replicas
    tokens_left = [0] * n_replicas
    budget_left = [0] * n_replicas
    ledger = budget_left if ROUTER_LEDGERS.get(router) == "budget" else tokens_left
    chosen = [0] * count
    started = [math.nan] * count
    first_token = [math.nan] * count
    finished = [math.nan] * count
    in_flight_seen = [0] * count
    step_ends: list[tuple[float, int]] = []  # (end time, replica) of the steps running now
    heappush, heappop = heapq.heappush, heapq.heappop

    def start_step(index: int, now: float) -> None:
        """Plan the replica's next step (decodes, continued prompts, admissions) and schedule its end."""
        replica = replicas[index]
        decodes = replica.decoding
        if not replica.prefilling and (replica.running >= max_seqs or not replica.waiting):
            # The common step: decodes only (what the general path below would plan, sooner).
            if not decodes:
                return
            ms = step_intercept + per_row * decodes + per_context * replica.context
            replica.plan_decodes, replica.plan_chunks, replica.plan_prefill_tokens = decodes, (), 0
            replica.step_started = now
            replica.stepping = True
            heappush(step_ends, (now + (ms if ms > floor_ms else floor_ms) / 1e3, index))
            return
        budget = budget_per_step - decodes
        chunks: list[tuple[list[int], int]] = []
        for entry in replica.prefilling:  # continue prompts already admitted, oldest first
            if budget <= 0:
                break
            chunk = entry[1] if entry[1] < budget else budget
            chunks.append((entry, chunk))
            budget -= chunk
        waiting = replica.waiting
        while waiting and replica.running < max_seqs and budget > 0:  # admit, first come first served
            request = waiting.popleft()
            prompt = prompts[request]
            chunk = prompt if prompt < budget else budget
            entry = [request, prompt]
            replica.prefilling.append(entry)
            replica.running += 1
            started[request] = now
            chunks.append((entry, chunk))
            budget -= chunk
        if not decodes and not chunks:
            return  # nothing to compute: the replica idles until the next arrival
        prefill_tokens = budget_per_step - decodes - budget
        if decodes:
            ms = step_intercept + per_row * decodes + per_context * replica.context
            if prefill_tokens:
                ms += prefill_intercept + prefill_per_token * prefill_tokens
        else:
            ms = only_intercept + only_per_token * prefill_tokens
        replica.plan_decodes, replica.plan_chunks, replica.plan_prefill_tokens = decodes, chunks, prefill_tokens
        replica.step_started = now
        replica.stepping = True
        heappush(step_ends, (now + (ms if ms > floor_ms else floor_ms) / 1e3, index))

    def end_step(index: int, now: float) -> None:
        """Apply the step that ends ``now``: a token per decode row, prompt chunks, first tokens, finished requests."""
        replica = replicas[index]
        replica.stepping = False
        began = replica.step_started
        if now > window_start and began < window_end:
            overlap = (now if now < window_end else window_end) - (began if began > window_start else window_start)
            replica.busy_s += overlap
            replica.running_s += overlap * replica.running
        step = replica.step
        replica.step = step + 1
        decodes = replica.plan_decodes
        replica.context += decodes  # every decode row's sequence is one position longer
        left = tokens_left[index] - decodes - replica.plan_prefill_tokens
        leaving = replica.finish_at.pop(step, None)
        if replica.plan_chunks:
            prompt_done = False
            for entry, chunk in replica.plan_chunks:
                entry[1] -= chunk
                if entry[1]:
                    continue  # a partial prompt: no token yet
                prompt_done = True
                request = entry[0]
                first_token[request] = now
                left -= 1
                answer = answers[request]
                replica.decoding += 1  # a decode row from the next step on (or, with one token, it leaves now)
                replica.context += prompts[request] + 1
                if answer == 1:
                    leaving = [*(leaving or ()), request]
                else:
                    due = step + answer - 1  # its last token: answer - 1 decode steps after this one
                    finish_at = replica.finish_at
                    if due in finish_at:
                        finish_at[due].append(request)
                    else:
                        finish_at[due] = [request]
            if prompt_done:
                replica.prefilling = [entry for entry in replica.prefilling if entry[1]]
        if leaving:
            for request in leaving:
                finished[request] = now
                replica.context -= prompts[request] + answers[request]
                left -= max_new[request] - answers[request]  # what the router counted but was never made
                budget_left[index] -= prompts[request] + max_new[request]
            gone = len(leaving)
            replica.decoding -= gone
            replica.running -= gone
            replica.finished += gone
            in_flight[index] -= gone
        tokens_left[index] = left

    next_arrival = 0
    next_time = arrivals[0] if count else math.inf
    while next_arrival < count or step_ends:
        if next_time <= (step_ends[0][0] if step_ends else math.inf):
            request, now = next_arrival, next_time
            next_arrival += 1
            next_time = arrivals[next_arrival] if next_arrival < count else math.inf
            index = choose(request, in_flight, ledger)
            chosen[request] = index
            in_flight_seen[request] = in_flight[index]
            in_flight[index] += 1
            tokens_left[index] += prompts[request] + max_new[request]
            budget_left[index] += prompts[request] + max_new[request]
            replica = replicas[index]
            replica.waiting.append(request)
            if not replica.stepping:
                start_step(index, now)
        else:
            now, index = heappop(step_ends)
            end_step(index, now)
            start_step(index, now)
    steps = sum(replica.step for replica in replicas)

    return Outcome(
        requests=requests, replica=np.asarray(chosen, dtype=np.int64), started_s=np.asarray(started),
        first_token_s=np.asarray(first_token), finished_s=np.asarray(finished),
        in_flight_at_arrival=np.asarray(in_flight_seen, dtype=np.int64),
        replica_busy_s=np.asarray([r.busy_s for r in replicas]), replica_running_s=np.asarray([r.running_s for r in replicas]),
        replica_finished=np.asarray([r.finished for r in replicas], dtype=np.int64),
        final_in_flight=np.asarray(in_flight, dtype=np.int64), final_tokens_left=np.asarray(tokens_left, dtype=np.int64),
        final_budget_left=np.asarray(budget_left, dtype=np.int64), steps=steps,
        window_s=(window_start, window_end),
    )


# ------------------------------------------------------------------------------------------------
# Metrics
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Slo:
    """A request is good when its time to first token and its mean time per later token are within these."""

    ttft_ms: float = SLO_TTFT_MS
    tpot_ms: float = SLO_TPOT_MS


def measured_window(requests: Requests, fractions: tuple[float, float] = MEASURED_WINDOW,
                    warmup_s: float = 0.0) -> tuple[slice, tuple[float, float]]:
    """The requests measured (an index slice) and the time window they arrive in (s).

    The window opens after the first ``fractions[0]`` of the arrivals and no earlier than
    ``warmup_s``, and closes after ``fractions[1]`` of them.
    """
    count = len(requests)
    arrivals = requests.arrival_s
    last = min(max(int(count * fractions[1]), 1), count - 1)
    first = max(int(count * fractions[0]), int(np.searchsorted(arrivals, warmup_s)))
    if first >= last:
        raise ValueError(f"no request arrives between {warmup_s} s (or {fractions[0]:.0%} of them) and {fractions[1]:.0%} of them")
    return slice(first, last), (float(arrivals[first]), float(arrivals[last]))


def summarise(outcome: Outcome, measured: slice, window: tuple[float, float], max_num_seqs: int,
              slo: Slo = Slo(), replica_limit: int = MAX_NUM_SEQS + MAX_QUEUE) -> dict[str, Any]:
    """The metrics of one simulated point, over the ``measured`` requests and the ``window`` (s) they arrived in.

    Latencies in milliseconds: ``latency`` arrival to last token, ``ttft`` arrival to first token,
    ``tpot`` (last - first) / (answer - 1) for answers of 2 tokens or more, ``queue`` arrival to the
    first step that computed it. ``goodput_rps``: measured requests within ``slo``, per second of
    the window. ``busy_fraction``: per replica, the share of the window spent in steps;
    ``batch_occupancy``: per replica, running sequences over ``max_num_seqs`` averaged over the
    window (both as mean, min and max over the replicas).
    ``over_replica_limit_share``: measured requests whose replica already held ``replica_limit``
    (what chapter 9 gives Serve as ``max_ongoing_requests``; Serve would have held them at its proxy).
    """
    r = outcome.requests
    arrival = r.arrival_s[measured]
    latency = (outcome.finished_s[measured] - arrival) * 1e3
    ttft = (outcome.first_token_s[measured] - arrival) * 1e3
    queue = (outcome.started_s[measured] - arrival) * 1e3
    answers = r.answer_tokens[measured]
    several = answers > 1
    tpot = np.full(len(answers), 0.0)
    tpot[several] = (outcome.finished_s[measured][several] - outcome.first_token_s[measured][several]) * 1e3 / (answers[several] - 1)
    good = (ttft <= slo.ttft_ms) & (tpot <= slo.tpot_ms)
    span = window[1] - window[0]
    finished_in_window = np.count_nonzero((outcome.finished_s >= window[0]) & (outcome.finished_s < window[1]))
    busy = outcome.replica_busy_s / span
    occupancy = outcome.replica_running_s / span / max_num_seqs

    def pct(values: np.ndarray, q: float) -> float:
        return round(float(np.percentile(values, q)), 1)

    return {
        "requests_measured": int(len(arrival)),
        "throughput_rps": round(finished_in_window / span, 2),
        "latency_ms": {"p50": pct(latency, 50), "p90": pct(latency, 90), "p99": pct(latency, 99), "max": pct(latency, 100)},
        "ttft_ms": {"p50": pct(ttft, 50), "p99": pct(ttft, 99)},
        "tpot_ms": {"p50": pct(tpot[several], 50), "p99": pct(tpot[several], 99)} if several.any() else None,
        "queue_ms": {"p50": pct(queue, 50), "p99": pct(queue, 99)},
        "goodput_rps": round(int(good.sum()) / span, 2),
        "goodput_share": round(float(good.mean()), 4),
        "busy_fraction": {"mean": round(float(busy.mean()), 3), "min": round(float(busy.min()), 3), "max": round(float(busy.max()), 3)},
        "batch_occupancy": {"mean": round(float(occupancy.mean()), 3), "min": round(float(occupancy.min()), 3),
                            "max": round(float(occupancy.max()), 3)},
        "over_replica_limit_share": round(float(np.mean(outcome.in_flight_at_arrival[measured] >= replica_limit)), 4),
    }


def replica_capacity(mix: RequestMix, config: ReplicaConfig, seed: int = DEFAULT_SEED, count: int = 4000) -> float:
    """Requests/s one replica finishes when it is never short of work (a backlog of ``count`` waiting at time 0).

    Measured between the 20th and the 80th percentile of finish times, past the first batch's
    start-up and before the backlog runs dry.
    """
    rng = np.random.default_rng([seed, _stable(mix.name), 0])
    prompts, answers, max_new = mix.draw(rng, count)
    outcome = simulate(Requests(np.zeros(count), prompts, answers, max_new), "random", 1, config, seed)
    finishes = np.sort(outcome.finished_s)
    low, high = int(0.2 * count), int(0.8 * count)
    return float((high - low) / (finishes[high] - finishes[low]))


def mean_decode_context(mix: RequestMix, seed: int = DEFAULT_SEED, count: int = 20_000) -> float:
    """Positions a decode row of ``mix`` attends to, on average over all decode steps (prompt + tokens so far).

    A request of prompt ``p`` and answer ``a`` decodes ``a - 1`` times, at ``p + 1`` ... ``p + a - 1`` positions.
    """
    prompts, answers, _ = mix.draw(np.random.default_rng([seed, _stable(mix.name), 1]), count)
    decodes = answers - 1
    return float(np.sum(decodes * prompts + decodes * (decodes + 1) / 2) / np.sum(decodes))


def _stable(name: str) -> int:
    """A seed from a name that is the same in every process (``hash`` of a string is not)."""
    return zlib.crc32(name.encode())


@dataclass(frozen=True)
class Point:
    """One simulated configuration of the sweep."""

    mix: str
    router: str
    replicas: int
    utilisation: float
    capacity_rps: float  # one replica's
    requests: int
    seed: int


def point_requests(point: Point) -> Requests:
    """The point's arrivals: the same for every router at the same mix, replicas and utilisation (common random numbers)."""
    rng = np.random.default_rng([point.seed, _stable(point.mix), point.replicas, round(point.utilisation * 1000)])
    return Requests.poisson(MIXES[point.mix], point.replicas * point.utilisation * point.capacity_rps, point.requests, rng)


def run_point(point: Point, config: ReplicaConfig, slo: Slo = Slo()) -> dict[str, Any]:
    """Simulate ``point`` and summarise it (one row of the sweep's ``points``)."""
    requests = point_requests(point)
    measured, window = measured_window(requests, warmup_s=simulated_seconds(MIXES[point.mix])[0])
    router_seed = np.random.SeedSequence([point.seed, _stable(point.router), point.replicas, round(point.utilisation * 1000)])
    outcome = simulate(requests, point.router, point.replicas, config, seed=int(router_seed.generate_state(1)[0]), window=window)
    offered = point.replicas * point.utilisation * point.capacity_rps
    return {"mix": point.mix, "router": point.router, "replicas": point.replicas, "utilisation": point.utilisation,
            "offered_rps": round(offered, 2), "requests_simulated": point.requests,
            **summarise(outcome, measured, window, config.max_num_seqs, slo)}


def requests_for(offered_rps: float, min_requests: int = MIN_REQUESTS, min_duration_s: float = MIN_DURATION_S) -> int:
    """Enough requests for a P99 (``min_requests``) and for a steady state (``min_duration_s`` of arrivals)."""
    return max(min_requests, math.ceil(offered_rps * min_duration_s))


def _run_point_star(args: tuple[Point, ReplicaConfig, Slo]) -> dict[str, Any]:
    return run_point(*args)


# ------------------------------------------------------------------------------------------------
# The sweep and what it assumes
# ------------------------------------------------------------------------------------------------


def assumptions(config: ReplicaConfig, slo: Slo, step_times: str) -> list[str]:
    """What the simulation assumes, as plain sentences (written into the sweep's JSON)."""
    return [
        f"Each replica is chapter 8's continuous batcher reduced to its arithmetic: at most {config.max_num_seqs} sequences "
        f"run at once (max_num_seqs) and a step computes at most {config.max_num_batched_tokens} tokens (max_num_batched_tokens); "
        "every running sequence whose prompt is computed decodes one token per step, then prompts already admitted continue, "
        "then waiting requests are admitted first come first served, a prompt longer than the budget left being chunked.",
        "A prompt's last chunk yields the first token; a request leaves at the end of the step that made its last token, and "
        "a request that arrives during a step waits for that step to end.",
        f"A step's duration depends only on what it computes: its decode rows, the positions they attend to (each row's "
        f"prompt plus the tokens it has so far) and its prompt tokens, by the formula of StepTimeModel with the constants "
        f"fitted from chapter 8's engine step timed in-process on this machine ({step_times}): chapter 8's default settings, "
        "one torch thread, no HTTP. A prompt chunk costs the same whatever history precedes it.",
        "Every replica has a core of its own, so its step time is the measured one whatever the other replicas do: 64 "
        "replicas are 64 such cores, not this machine's two, with no contention for memory bandwidth between them.",
        "Nothing but the step loop takes time: no HTTP, no event loop sharing the interpreter with the step thread, no "
        "network between router and replica, no proxy hop. The validation block compares one simulated replica with "
        "chapter 8's measured open loop to show what this leaves out.",
        "The KV pool never runs short (chapter 4's rule sizes it for max_num_seqs sequences at the full context), so no "
        "sequence is ever preempted, and no request is cancelled, times out or fails.",
        "Arrivals are a Poisson process. The offered rate is replicas x utilisation x one replica's capacity, where capacity "
        "is the requests/s one simulated replica finishes when it is never short of waiting requests (a full batch).",
        "Queues are unbounded: no request is refused (429) or held at Serve's proxy. over_replica_limit_share counts the "
        f"measured requests whose replica already held max_num_seqs + max_queue = {config.max_num_seqs + MAX_QUEUE} requests, "
        "chapter 9's max_ongoing_requests, where Serve would have held them at the proxy instead.",
        "Routers decide instantly, from exact counters as each replica's last step left them. random draws a replica "
        "uniformly; pow2 (Serve's default) draws two distinct replicas and takes the one with fewer requests in flight, "
        "the first drawn on a tie; least-tokens and least-remaining look at every replica (one router that sees them all) "
        "and take the one with the fewest tokens by their count, ties going to the first at or after a random offset.",
        "least-tokens counts what chapter 9's router counts: each request's prompt plus max_new_tokens, from when it is "
        "routed until it finishes (a proxy sees requests leave, not their progress). least-remaining counts what a replica "
        "could report: for each request, its prompt tokens not yet prefilled plus max_new_tokens minus the tokens generated "
        "so far. Both know what each request asks for, not how long its answer will be. In the mixed and default mixes a "
        "request asks exactly its answer's length (chapter 8 generates exactly max_new_tokens); in mixed-capped every "
        "request asks 256 tokens and stops at its answer, so both over-count.",
        f"Latency runs from arrival at the router to the end of the step that made the last token. Measured requests are "
        f"those arriving after the first {MEASURED_WINDOW[0]:.0%} of the arrivals and after a warm-up ({WARMUP_S:.0f} s "
        f"for answers of up to 256 tokens, less in proportion for shorter ones, down to a third: empty replicas filling "
        f"up), and before the last {1 - MEASURED_WINDOW[1]:.0%} (queues draining once arrivals stop). Each point simulates "
        f"at least {MIN_REQUESTS} requests and {MIN_DURATION_S:.0f} s of arrivals (scaled as the warm-up): a short run "
        "understates the tail of a router that lets queues grow slowly, as random does near capacity.",
        f"Goodput is the measured requests per second whose time to first token is at most {slo.ttft_ms:.0f} ms and whose "
        f"time per later token is at most {slo.tpot_ms:.0f} ms on average (the SLO of chapter 8's streaming comparison).",
        "One seed makes every figure reproducible; at a given mix, replica count and utilisation every router sees the same "
        "arrivals and the same request sizes.",
    ]


def environment() -> dict[str, Any]:
    """The machine and the code, in the words benchmarks/environment.py records them (without importing it,
    since chapters do not depend on benchmarks, nor torch, which ``run`` does not need)."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--", ".", ":(exclude)benchmarks/reference")
    cpu_model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    try:
        torch_version = metadata.version("torch")
    except Exception:  # noqa: BLE001 - a description, never a reason to fail
        torch_version = None
    return {
        "git_commit": git("rev-parse", "HEAD"), "git_dirty": None if status is None else bool(status),
        "python": platform.python_version(), "torch": torch_version, "numpy": np.__version__,
        "platform": platform.platform(), "cpu_model": cpu_model, "logical_cores": os.cpu_count() or 1,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }


def _repo_path(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def validate_against_open_loop(config: ReplicaConfig, open_loop: Path, seed: int, count: int = 4000) -> dict[str, Any]:
    """One simulated replica at the offered rates of chapter 8's measured open loop, beside what was measured.

    The open loop's server ran the ``default`` workload on one pinned core with HTTP, Locust on the
    other; the simulation has neither, so the difference is what the model leaves out.
    """
    document = json.loads(Path(open_loop).read_text())
    rows = []
    for level in document["levels"]:
        rate = float(level["offered_rps"])
        rng = np.random.default_rng([seed, _stable("validation"), round(rate * 1000)])
        requests = Requests.poisson(MIXES["default"], rate, count, rng)
        measured, window = measured_window(requests, warmup_s=simulated_seconds(MIXES["default"])[0])
        outcome = simulate(requests, "random", 1, config, seed, window=window)
        simulated = summarise(outcome, measured, window, config.max_num_seqs)
        rows.append({
            "offered_rps": rate,
            "measured": {"qps": round(level["qps"], 2), "p50_ms": round(level["latency_ms"]["p50"], 1),
                         "p99_ms": round(level["latency_ms"]["p99"], 1), "requests": level["requests_ok"]},
            "simulated": {"throughput_rps": simulated["throughput_rps"], "p50_ms": simulated["latency_ms"]["p50"],
                          "p99_ms": simulated["latency_ms"]["p99"], "batch_occupancy": simulated["batch_occupancy"]["mean"]},
        })
    return {"source": _repo_path(open_loop), "workload": "default", "requests_per_rate": count, "levels": rows}


def validate_step_model(model: StepTimeModel, result_files: Sequence[Path], context_per_row: float) -> dict[str, Any]:
    """The step model against the step records chapter 8's server kept under load (``server_series.steps``).

    Those records lack the positions each decode row attended to, so the prediction gives every
    row ``context_per_row`` positions; the ratio is recorded / predicted.
    """
    ratios = []
    used = []
    for path in result_files:
        if not Path(path).exists():
            continue
        document = json.loads(Path(path).read_text())
        used.append(_repo_path(path))
        for level in document.get("levels", []):
            for record in (level.get("server_series") or {}).get("steps") or []:
                rows, prefill = int(record["decode_rows"]), int(record["prefill_tokens"])
                recorded = record["schedule_ms"] + record["prepare_ms"] + record["model_ms"] + record["update_ms"]
                predicted = model.step_ms(rows, prefill, context_per_row * rows)
                ratios.append(recorded / predicted)
    if not ratios:
        return {"sources": used, "records": 0}
    q25, q50, q75 = np.percentile(ratios, [25, 50, 75])
    return {"sources": used, "records": len(ratios), "context_per_row_assumed": round(context_per_row, 1),
            "recorded_over_predicted": {"p25": round(float(q25), 3), "median": round(float(q50), 3), "p75": round(float(q75), 3)}}


def sweep(config: ReplicaConfig, *, mixes: Sequence[str] = tuple(MIXES), routers: Sequence[str] = ROUTERS,
          replica_counts: Sequence[int] = REPLICA_COUNTS, utilisations: Sequence[float] = UTILISATIONS,
          seed: int = DEFAULT_SEED, min_requests: int = MIN_REQUESTS, min_duration_s: float = MIN_DURATION_S,
          slo: Slo = Slo(), workers: int = 1) -> dict[str, Any]:
    """Every (mix, router, replicas, utilisation) point, with each mix's one-replica capacity; deterministic for ``seed``."""
    capacities = {mix: replica_capacity(MIXES[mix], config, seed) for mix in mixes}
    scale = {mix: simulated_seconds(MIXES[mix])[1] / MIN_DURATION_S for mix in mixes}
    points = [Point(mix, router, replicas, utilisation, capacities[mix],
                    requests_for(replicas * utilisation * capacities[mix], min_requests, min_duration_s * scale[mix]), seed)
              for mix in mixes for router in routers for replicas in replica_counts for utilisation in utilisations]
    jobs = [(point, config, slo) for point in points]
    if workers > 1:
        # The biggest points first, so that no worker is left with one of them at the end.
        order = sorted(range(len(jobs)), key=lambda i: -points[i].requests)
        with ProcessPoolExecutor(workers) as pool:
            done = dict(zip(order, pool.map(_run_point_star, [jobs[i] for i in order], chunksize=1)))
        rows = [done[i] for i in range(len(jobs))]
    else:
        rows = [_run_point_star(job) for job in jobs]
    return {
        "mixes": {mix: {"description": MIXES[mix].description, "capacity_rps_per_replica": round(capacities[mix], 2),
                        "warmup_s": round(simulated_seconds(MIXES[mix])[0], 2),
                        "min_arrival_s": round(min_duration_s * scale[mix], 2)}
                  for mix in mixes},
        "points": rows,
    }


def run(step_times: Path, out: Path, seed: int = DEFAULT_SEED, workers: int = 2, min_requests: int = MIN_REQUESTS,
        min_duration_s: float = MIN_DURATION_S, open_loop: Path = OPEN_LOOP_REFERENCE,
        routers: Sequence[str] = ROUTERS) -> dict[str, Any]:
    """The ``run`` command: the sweep, the validations, the assumptions and the inputs, written to ``out``."""
    started = time.perf_counter()
    model = StepTimeModel.from_file(step_times)
    config = ReplicaConfig(model)
    slo = Slo()
    result = sweep(config, routers=routers, seed=seed, workers=workers, min_requests=min_requests,
                   min_duration_s=min_duration_s, slo=slo)
    document = {
        "what": "chapter 8's continuous batcher as 1 to 64 replicas behind three routers, simulated under Poisson arrivals",
        "command": (f"python -m chapters.ch09_scale_out.simulation run --step-times {_repo_path(step_times)} "
                    f"--out {_repo_path(out)} --seed {seed}" + ("" if tuple(routers) == ROUTERS else f" --routers {' '.join(routers)}")),
        "seed": seed,
        "inputs": {
            "step_times": _repo_path(step_times),
            "request_mixes": ["benchmarks/workload.py (prompt lengths, the default workload's 32 new tokens)",
                              "benchmarks/streaming.py (the mixed workload's answers, 8 to 256 tokens, log-uniform)"],
            "validation": [_repo_path(open_loop), _repo_path(REPO_ROOT / "benchmarks/reference/cpu/ch08.json")],
        },
        "assumptions": assumptions(config, slo, _repo_path(step_times)),
        "settings": {
            "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_queue": MAX_QUEUE, "routers": list(routers), "replicas": list(REPLICA_COUNTS),
            "utilisations": list(UTILISATIONS), "slo": asdict(slo), "min_requests": min_requests,
            "min_duration_s": min_duration_s, "warmup_s": WARMUP_S, "measured_arrival_fractions": list(MEASURED_WINDOW),
            "note": "min_duration_s and warmup_s are for answers of up to 256 tokens; each mix's own are under mixes",
        },
        "step_model": {key: value for key, value in model.describe().items() if key != "source"},
        **result,
        "validation": {
            "one_replica_vs_open_loop": validate_against_open_loop(config, REPO_ROOT / open_loop, seed),
            "step_model_vs_server_records": validate_step_model(
                model, [REPO_ROOT / open_loop, REPO_ROOT / "benchmarks/reference/cpu/ch08.json"],
                mean_decode_context(MIXES["default"], seed)),
        },
        "environment": environment(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"{len(result['points'])} points in {time.perf_counter() - started:.1f} s -> {out}")
    return document


# ------------------------------------------------------------------------------------------------
# Measuring chapter 8's step
# ------------------------------------------------------------------------------------------------

# Decode rows timed: every bucket edge of chapter 8's compiled attention (16, 32, 64) and one past it,
# denser where the step changes fastest; two histories per row count give the cost per position read.
MEASURE_DECODE_ROWS: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 17, 24, 32, 33, 40, 48, 56, 64)
MEASURE_HISTORIES: tuple[int, int] = (64, 256)
MEASURE_PREFILL_BESIDE: tuple[int, ...] = (0, 8, 32, 63)  # decode rows beside the prompt (63: the 64th row is the prompt)
MEASURE_PROMPTS: tuple[int, ...] = (16, 32, 64, 128, 256, 448)


def measure(out: Path, rounds: int = 3, timed_steps: int = 6, prefill_repeats: int = 3, seed: int = 0) -> dict[str, Any]:
    """Time chapter 8's engine step in-process and write the medians and the fitted :class:`StepTimeModel` to ``out``.

    The engine is the server's own (``build_backend`` with chapter 8's default settings, the
    default weights, one torch thread); each step is turned by its step thread's ``step`` and its
    duration is the step clock's (schedule + prepare + model + update), as ``/stats`` reports it.
    Rounds visit every configuration in a new random order, so that a busy moment of a shared
    machine spreads over all of them; each figure is the median over the rounds.
    """
    from shared.devices import choose_device, set_threads
    from shared.weights import load_model
    from chapters.ch08_continuous_batching.scheduler import Sequence as SchedulerSequence
    from chapters.ch08_continuous_batching.server import ContinuousSettings, build_backend

    started = time.perf_counter()
    machine = environment()  # before the measuring loads the machine (its load average)
    settings = ContinuousSettings(weights="default", device="cpu", torch_threads=1)
    set_threads(settings.torch_threads)
    loaded = load_model(settings.weights, settings.preset, choose_device(settings.device), settings.torch_dtype)
    backend = build_backend(settings, loaded)
    engine = backend.step_thread
    scheduler = engine.scheduler
    n_ctx = loaded.config.n_ctx
    rng = random.Random(seed)

    def new_sequence(prompt_tokens: int, max_new_tokens: int) -> SchedulerSequence:
        return SchedulerSequence([rng.randrange(256) for _ in range(prompt_tokens)], max_new_tokens)

    def timed_step() -> tuple[float, float, Any]:
        """One engine step: its CPU time (ms, this thread's), its wall time (ms, the step clock's) and its record.

        The model is fitted to CPU time: on a shared machine a step's wall time also counts the
        moments another process held the core, and the simulation gives every replica a core of its own.
        """
        cpu_started = time.thread_time()
        engine.step()
        cpu_ms = (time.thread_time() - cpu_started) * 1e3
        record = engine.clock.recent[-1]
        return cpu_ms, record.schedule_ms + record.prepare_ms + record.model_ms + record.update_ms, record

    def decoding(rows: int, history: int) -> list[SchedulerSequence]:
        """``rows`` sequences with ``history``-token prompts, all prompts computed, decoding."""
        sequences = [new_sequence(history, n_ctx - history) for _ in range(rows)]
        for sequence in sequences:
            scheduler.add(sequence)
        while any(s.num_computed < len(s.prompt_ids) for s in sequences):
            engine.step()
        return sequences

    def expect(record: Any, rows: int, prompt_tokens: int) -> None:
        if record.decode_rows != rows or record.prefill_tokens != prompt_tokens:
            raise RuntimeError(f"the step computed {record} instead of {rows} decode rows and {prompt_tokens} prompt tokens")

    def clear(sequences: list[SchedulerSequence]) -> None:
        for sequence in sequences:
            scheduler.abort(sequence)

    # (rows, history) or (rows, prompt tokens) -> CPU and wall milliseconds of each timed step
    decode_cpu: dict[tuple[int, int], list[float]] = {}
    decode_wall: dict[tuple[int, int], list[float]] = {}
    context_samples: dict[tuple[int, int], list[float]] = {}
    prefill_cpu: dict[tuple[int, int], list[float]] = {}
    prefill_wall: dict[tuple[int, int], list[float]] = {}
    decode_configs = [(rows, history) for history in MEASURE_HISTORIES for rows in MEASURE_DECODE_ROWS]
    prefill_configs = [(rows, prompt) for rows in MEASURE_PREFILL_BESIDE for prompt in MEASURE_PROMPTS]
    for _ in range(rounds):
        rng.shuffle(decode_configs)
        for rows, history in decode_configs:
            sequences = decoding(rows, history)
            engine.step()  # the first step of every sequence's decoding, untimed
            for _ in range(timed_steps):
                context = sum(len(s.token_ids) for s in sequences)
                cpu_ms, wall_ms, record = timed_step()
                expect(record, rows, 0)
                decode_cpu.setdefault((rows, history), []).append(cpu_ms)
                decode_wall.setdefault((rows, history), []).append(wall_ms)
                context_samples.setdefault((rows, history), []).append(context / rows)
            clear(sequences)
        rng.shuffle(prefill_configs)
        for rows, prompt in prefill_configs:
            prompt = min(prompt, MAX_NUM_BATCHED_TOKENS - rows)
            sequences = decoding(rows, MEASURE_HISTORIES[0]) if rows else []
            for _ in range(prefill_repeats):
                # A prompt of one new token leaves at the end of its prefill step, so the rows stay as they were.
                before = timed_step() if rows else (0.0, 0.0, None)
                scheduler.add(new_sequence(prompt, 1))
                cpu_ms, wall_ms, record = timed_step()
                expect(record, rows, prompt)
                if rows:  # what the prompt added to the decode steps around it
                    after = timed_step()
                    cpu_ms -= (before[0] + after[0]) / 2
                    wall_ms -= (before[1] + after[1]) / 2
                prefill_cpu.setdefault((rows, prompt), []).append(cpu_ms)
                prefill_wall.setdefault((rows, prompt), []).append(wall_ms)
            clear(sequences)

    def median(values: list[float]) -> float:
        return float(np.median(values))

    # Decode: least squares of the per-configuration medians on (1, rows, positions read), both histories together.
    decode_keys = [(rows, history) for history in MEASURE_HISTORIES for rows in MEASURE_DECODE_ROWS]
    design = np.array([[1.0, rows, rows * np.mean(context_samples[(rows, history)])] for rows, history in decode_keys])
    observed = np.array([median(decode_cpu[key]) for key in decode_keys])
    (intercept, per_row, per_context), *_ = np.linalg.lstsq(design, observed, rcond=None)
    decode_residual = observed - design @ np.array([intercept, per_row, per_context])

    def line(points: list[tuple[int, float]]) -> tuple[float, float, float]:
        """Intercept, slope and residual RMS of the least-squares line through ``points``."""
        xs, ys = np.array([p[0] for p in points], dtype=float), np.array([p[1] for p in points])
        slope, intercept = np.polyfit(xs, ys, 1)
        return float(intercept), float(slope), float(np.sqrt(np.mean((ys - intercept - slope * xs) ** 2)))

    only = line([(p, median(samples)) for (rows, p), samples in prefill_cpu.items() if rows == 0])
    beside = line([(p, median(samples)) for (rows, p), samples in prefill_cpu.items() if rows > 0])
    model = StepTimeModel(
        step_intercept_ms=round(float(intercept), 4), ms_per_decode_row=round(float(per_row), 5),
        ms_per_context_token=round(float(per_context), 7),
        prefill_intercept_ms=round(beside[0], 4), prefill_ms_per_token=round(beside[1], 6),
        prefill_only_intercept_ms=round(only[0], 4), prefill_only_ms_per_token=round(only[1], 6),
    )
    document = {
        "what": "chapter 8's engine step, timed in-process: decode steps by rows and history, and what a prompt adds to a step",
        "command": f"python -m chapters.ch09_scale_out.simulation measure --out {_repo_path(out)} --rounds {rounds}",
        "engine": backend.description,
        "settings": {"max_num_seqs": settings.max_num_seqs, "max_num_batched_tokens": settings.max_num_batched_tokens,
                     "kv_policy": settings.kv_policy, "torch_threads": settings.torch_threads, "weights": settings.weights},
        "method": (f"{rounds} rounds, each visiting every configuration in a new random order. Decode: fresh sequences "
                   f"with prompts of the history's length, prefilled, one untimed decode step, then {timed_steps} timed "
                   f"decode steps. Prefill: one prompt of one new token added beside the decode rows ({prefill_repeats} "
                   "times a round), the step's time minus the mean of the pure decode steps before and after it (with "
                   "no decode rows: the step's whole time). cpu_ms: the step thread's CPU time over the whole step, what "
                   "the model is fitted to (a replica with a core of its own); wall_ms: the step clock's schedule + "
                   "prepare + model + update, as chapter 8's /stats reports it, which on a shared machine also counts "
                   "time other processes held the core. Medians over all rounds."),
        "decode": {
            "rows": list(MEASURE_DECODE_ROWS),
            "by_history": {str(history): {
                "cpu_ms": [round(median(decode_cpu[(rows, history)]), 3) for rows in MEASURE_DECODE_ROWS],
                "wall_ms": [round(median(decode_wall[(rows, history)]), 3) for rows in MEASURE_DECODE_ROWS],
                "context_per_row": [round(float(np.mean(context_samples[(rows, history)])), 1) for rows in MEASURE_DECODE_ROWS],
                "samples_per_rows": rounds * timed_steps,
            } for history in MEASURE_HISTORIES},
        },
        "prefill": [{"decode_rows": rows, "prompt_tokens": prompt, "what": "added to the step" if rows else "the whole step",
                     "cpu_ms": round(median(samples), 3), "wall_ms": round(median(prefill_wall[(rows, prompt)]), 3),
                     "samples": len(samples)} for (rows, prompt), samples in sorted(prefill_cpu.items())],
        "model": model.describe(),
        "model_formula": STEP_TIME_FORMULA,
        "fit": {
            "decode": "least squares of the decode cpu_ms medians, both histories, on 1, rows and rows x positions per row",
            "decode_residual_rms_ms": round(float(np.sqrt(np.mean(decode_residual ** 2))), 3),
            "decode_residual_max_ms": round(float(np.max(np.abs(decode_residual))), 3),
            "prefill": "least squares lines of the prefill cpu_ms medians on prompt tokens, with and without decode rows beside",
            "prefill_residual_rms_ms": {"beside_decodes": round(beside[2], 3), "alone": round(only[2], 3)},
        },
        "environment": {**machine, "torch_threads": settings.torch_threads},
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"step times in {document['elapsed_s']} s -> {out}")
    return document


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m chapters.ch09_scale_out.simulation", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    measuring = commands.add_parser("measure", help="time chapter 8's engine step in-process; write the step-time model")
    measuring.add_argument("--out", type=Path, default=DEFAULT_STEP_TIMES)
    measuring.add_argument("--rounds", type=int, default=3)
    running = commands.add_parser("run", help="the sweep: routers x replicas x utilisations x mixes")
    running.add_argument("--step-times", type=Path, default=DEFAULT_STEP_TIMES)
    running.add_argument("--out", type=Path, default=DEFAULT_OUT)
    running.add_argument("--seed", type=int, default=DEFAULT_SEED)
    running.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    running.add_argument("--routers", nargs="+", choices=sorted(ROUTER_FACTORIES), default=list(ROUTERS))
    args = parser.parse_args(argv)
    if args.command == "measure":
        measure(args.out, rounds=args.rounds)
    else:
        run(args.step_times, args.out, seed=args.seed, workers=args.workers, routers=args.routers)


if __name__ == "__main__":
    main(sys.argv[1:])
