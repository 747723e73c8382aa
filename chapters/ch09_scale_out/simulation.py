"""Scaling past this machine, in simulation: replicas of chapter 8's batcher behind a router, as a discrete-event model.

One replica is chapter 8's scheduler reduced to arithmetic (:func:`simulate`), its steps timed by a :class:`StepTimeModel`,
requests reaching it through one of :data:`ROUTERS`. The study ``benchmarks/studies/scale_out_simulation/`` measures the
step times and sweeps routers, replica counts and loads."""

from __future__ import annotations

import heapq
import json
import math
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from chapters.ch08_continuous_batching.scheduler import SchedulerConfig

ROUTERS: tuple[str, ...] = ("random", "pow2", "least-tokens", "least-remaining")
# The benchmarks' request mixes (chapters may not import benchmarks): tests/test_ch09_simulation.py holds them equal.
ARTICLE_PROMPT_LENGTHS: tuple[int, ...] = (16, 32, 64, 128)
DEFAULT_NEW_TOKENS = 32
MIXED_NEW_TOKENS: tuple[int, int] = (8, 256)

DEFAULT_SEED = 1234
DEFAULT_STEP_TIMES = Path("benchmarks/reference/cpu/ch09/step-times.json")  # the step model the study measured


@dataclass(frozen=True)
class RequestMix:
    """Prompt and answer lengths of a stream of requests: prompts uniformly from ``prompt_lengths``, answers (tokens really
    generated) from ``answer_lengths`` (by ``answer_weights``, else uniform) or log-uniform in ``log_uniform_answers``, rounded.
    ``max_new_tokens``: ``None``, each asks exactly its answer; a number, each asks that many and stops at its answer."""
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

STEP_TIME_FORMULA = (
    "step_ms = step_intercept_ms + ms_per_decode_row x decode rows + ms_per_context_token x positions the decode rows "
    "attend to, + prefill_intercept_ms + prefill_ms_per_token x prompt tokens when the step also prefills; a step "
    "without decode rows: prefill_only_intercept_ms + prefill_only_ms_per_token x prompt tokens"
)


@dataclass(frozen=True)
class StepTimeModel:
    """The duration of one step of chapter 8's engine, in milliseconds (:data:`STEP_TIME_FORMULA`): a fixed cost per step, a
    cost per decode row, per position the rows attend to (each: its prompt plus its tokens so far) and per prompt token; a
    step without decode rows has its own fixed cost and cost per prompt token. Never below ``floor_ms``."""
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
        """The model the study's ``measure`` command wrote (its ``model`` block)."""
        return cls(**json.loads(Path(path).read_text())["model"])

    def step_ms(self, decode_rows: int, prefill_tokens: int, context: float) -> float:
        """Milliseconds of one step (:data:`STEP_TIME_FORMULA`)."""
        if decode_rows == 0:
            ms = self.prefill_only_intercept_ms + self.prefill_only_ms_per_token * prefill_tokens
        else:
            ms = self.step_intercept_ms + self.ms_per_decode_row * decode_rows + self.ms_per_context_token * context
            if prefill_tokens:
                ms += self.prefill_intercept_ms + self.prefill_ms_per_token * prefill_tokens
        return max(ms, self.floor_ms)

    def describe(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ReplicaConfig:
    """What each replica runs: chapter 8's scheduler budgets (its defaults, checked by its own rule) and its step time."""
    step_model: StepTimeModel
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens

    def __post_init__(self) -> None:
        SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens)  # raises ValueError as chapter 8 would


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


# A router is made per run: ``factory(replicas, rng, requests)`` returns ``choose(request index, requests in flight per replica,
# tokens per replica (ROUTER_LEDGERS)) -> replica``; its random draws are made up front, so a run is one seed.
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
    """The replica with the fewest tokens (ROUTER_LEDGERS); a tie goes to the first at or after a random offset: ties spread."""
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
# The tokens a router is handed: by default those still to compute (least-remaining: what replicas reporting progress allow);
# "budget", each request's prompt + max_new_tokens until it finishes (least-tokens: what a proxy seeing only ends can count).
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


class _Cluster:
    """:func:`simulate`'s state: the replicas, the router's counters, every request's times. Events, in time order: a request
    arrives (the router picks a replica, which plans a step if idle), or a step ends (its tokens applied, the next planned)."""
    def __init__(self, requests: Requests, router: str, n_replicas: int, config: ReplicaConfig, seed: int,
                 window: tuple[float, float] | None) -> None:
        if router not in ROUTER_FACTORIES:
            raise ValueError(f"unknown router {router!r}; known: {', '.join(ROUTER_FACTORIES)}")
        if n_replicas < 1:
            raise ValueError("need at least one replica")
        count = len(requests)
        self.requests = requests
        self.choose = ROUTER_FACTORIES[router](n_replicas, np.random.default_rng(seed), count)
        self.arrivals, self.prompts = requests.arrival_s.tolist(), requests.prompt_tokens.tolist()
        self.answers, self.max_new = requests.answer_tokens.tolist(), requests.max_new_tokens.tolist()
        self.step_ms = config.step_model.step_ms
        self.max_seqs, self.budget_per_step = config.max_num_seqs, config.max_num_batched_tokens
        self.window = window if window is not None else (0.0, math.inf)
        self.replicas = [_Replica() for _ in range(n_replicas)]
        # The routers' counters, per replica: requests in flight, tokens still to compute, whole budgets.
        self.in_flight, self.tokens_left, self.budget_left = [0] * n_replicas, [0] * n_replicas, [0] * n_replicas
        self.ledger = self.budget_left if ROUTER_LEDGERS.get(router) == "budget" else self.tokens_left
        self.chosen, self.in_flight_seen = [0] * count, [0] * count
        self.started, self.first_token, self.finished = [math.nan] * count, [math.nan] * count, [math.nan] * count
        self.step_ends: list[tuple[float, int]] = []  # (end time, replica) of the steps running now

    def run(self) -> Outcome:
        arrivals, count, step_ends = self.arrivals, len(self.arrivals), self.step_ends
        next_arrival = 0
        while next_arrival < count or step_ends:
            if next_arrival < count and arrivals[next_arrival] <= (step_ends[0][0] if step_ends else math.inf):
                self.arrive(next_arrival, arrivals[next_arrival])
                next_arrival += 1
            else:
                now, index = heapq.heappop(step_ends)
                self.end_step(index, now)
                self.start_step(index, now)
        return self.outcome()

    def arrive(self, request: int, now: float) -> None:
        index = self.choose(request, self.in_flight, self.ledger)
        self.chosen[request] = index
        self.in_flight_seen[request] = self.in_flight[index]
        self.in_flight[index] += 1
        self.tokens_left[index] += self.prompts[request] + self.max_new[request]
        self.budget_left[index] += self.prompts[request] + self.max_new[request]
        replica = self.replicas[index]
        replica.waiting.append(request)
        if not replica.stepping:
            self.start_step(index, now)

    def start_step(self, index: int, now: float) -> None:
        """Plan the replica's next step (decodes, continued prompts, admissions) and schedule its end."""
        replica = self.replicas[index]
        decodes = replica.decoding
        if not replica.prefilling and (replica.running >= self.max_seqs or not replica.waiting):
            chunks: list[tuple[list[int], int]] = []  # the common step: decodes only, no planning
            if not decodes:
                return
        else:
            chunks = self.plan_prefills(replica, self.budget_per_step - decodes, now)
            if not decodes and not chunks:
                return  # nothing to compute: the replica idles until the next arrival
        prefill_tokens = sum(chunk for _, chunk in chunks)
        replica.plan_decodes, replica.plan_chunks, replica.plan_prefill_tokens = decodes, chunks, prefill_tokens
        replica.step_started = now
        replica.stepping = True
        heapq.heappush(self.step_ends, (now + self.step_ms(decodes, prefill_tokens, replica.context) / 1e3, index))

    def plan_prefills(self, replica: _Replica, budget: int, now: float) -> list[tuple[list[int], int]]:
        """The step's prompt chunks within ``budget``: prompts already admitted first, then admissions."""
        chunks: list[tuple[list[int], int]] = []
        for entry in replica.prefilling:  # continue prompts already admitted, oldest first
            if budget <= 0:
                break
            chunk = entry[1] if entry[1] < budget else budget
            chunks.append((entry, chunk))
            budget -= chunk
        waiting = replica.waiting
        while waiting and replica.running < self.max_seqs and budget > 0:  # admit, first come first served
            request = waiting.popleft()
            prompt = self.prompts[request]
            chunk = prompt if prompt < budget else budget
            entry = [request, prompt]
            replica.prefilling.append(entry)
            replica.running += 1
            self.started[request] = now
            chunks.append((entry, chunk))
            budget -= chunk
        return chunks

    def end_step(self, index: int, now: float) -> None:
        """Apply the step that ends ``now``: a token per decode row, prompt chunks, first tokens, finished requests."""
        replica = self.replicas[index]
        replica.stepping = False
        began, (window_start, window_end) = replica.step_started, self.window
        if now > window_start and began < window_end:
            overlap = (now if now < window_end else window_end) - (began if began > window_start else window_start)
            replica.busy_s += overlap
            replica.running_s += overlap * replica.running
        step = replica.step
        replica.step = step + 1
        decodes = replica.plan_decodes
        replica.context += decodes  # every decode row's sequence is one position longer
        left = self.tokens_left[index] - decodes - replica.plan_prefill_tokens
        leaving = replica.finish_at.pop(step, None) or []
        if replica.plan_chunks:
            first_tokens = self.apply_chunks(replica, step, now, leaving)
            left -= first_tokens
        if leaving:
            left = self.leave(index, replica, leaving, now, left)
        self.tokens_left[index] = left

    def apply_chunks(self, replica: _Replica, step: int, now: float, leaving: list[int]) -> int:
        """The step's prompt chunks: a prompt computed whole yields its first token and becomes a decode row
        (or leaves now, with a one-token answer: added to ``leaving``). Returns how many first tokens were made."""
        made = 0
        for entry, chunk in replica.plan_chunks:
            entry[1] -= chunk
            if entry[1]:
                continue  # a partial prompt: no token yet
            made += 1
            request = entry[0]
            self.first_token[request] = now
            answer = self.answers[request]
            replica.decoding += 1  # a decode row from the next step on (or, with one token, it leaves now)
            replica.context += self.prompts[request] + 1
            if answer == 1:
                leaving.append(request)
            else:  # its last token: answer - 1 decode steps after this one
                replica.finish_at.setdefault(step + answer - 1, []).append(request)
        if made:
            replica.prefilling = [entry for entry in replica.prefilling if entry[1]]
        return made

    def leave(self, index: int, replica: _Replica, leaving: list[int], now: float, left: int) -> int:
        """The requests whose last token the step made leave; returns the replica's tokens still to compute."""
        for request in leaving:
            self.finished[request] = now
            replica.context -= self.prompts[request] + self.answers[request]
            left -= self.max_new[request] - self.answers[request]  # what the router counted but was never made
            self.budget_left[index] -= self.prompts[request] + self.max_new[request]
        gone = len(leaving)
        replica.decoding -= gone
        replica.running -= gone
        replica.finished += gone
        self.in_flight[index] -= gone
        return left

    def outcome(self) -> Outcome:
        replicas = self.replicas
        return Outcome(
            requests=self.requests, replica=np.asarray(self.chosen, dtype=np.int64), started_s=np.asarray(self.started),
            first_token_s=np.asarray(self.first_token), finished_s=np.asarray(self.finished),
            in_flight_at_arrival=np.asarray(self.in_flight_seen, dtype=np.int64),
            replica_busy_s=np.asarray([r.busy_s for r in replicas]), replica_running_s=np.asarray([r.running_s for r in replicas]),
            replica_finished=np.asarray([r.finished for r in replicas], dtype=np.int64),
            final_in_flight=np.asarray(self.in_flight, dtype=np.int64),
            final_tokens_left=np.asarray(self.tokens_left, dtype=np.int64),
            final_budget_left=np.asarray(self.budget_left, dtype=np.int64), steps=sum(r.step for r in replicas),
            window_s=self.window,
        )


def simulate(requests: Requests, router: str, n_replicas: int, config: ReplicaConfig, seed: int = DEFAULT_SEED,
             window: tuple[float, float] | None = None) -> Outcome:
    """Run ``requests`` through ``n_replicas`` replicas behind ``router`` until every request has finished; deterministic for a
    ``seed`` (the router's draws). A replica plans a step when idle and a request arrives, or when its step ends with work left,
    as chapter 8's scheduler would with :class:`ReplicaConfig`'s budgets: a token per decoding sequence, prompts continued, then
    waiting requests admitted first come first served, prompts chunked to the token budget left. A prompt's last chunk yields
    the first token; a sequence leaves when the step that made its last token ends. Routers see the counters as of each
    replica's last step end. ``window`` (s) bounds where busy time and occupancy are counted (default: the whole run)."""
    return _Cluster(requests, router, n_replicas, config, seed, window).run()


def replica_capacity(mix: RequestMix, config: ReplicaConfig, seed: int = DEFAULT_SEED, count: int = 4000) -> float:
    """Requests/s one replica finishes when it is never short of work (a backlog of ``count`` waiting at time 0), between the
    20th and the 80th percentile of finish times: past the first batch's start-up, before the backlog runs dry."""
    rng = np.random.default_rng([seed, stable_seed(mix.name), 0])
    prompts, answers, max_new = mix.draw(rng, count)
    outcome = simulate(Requests(np.zeros(count), prompts, answers, max_new), "random", 1, config, seed)
    finishes = np.sort(outcome.finished_s)
    low, high = int(0.2 * count), int(0.8 * count)
    return float((high - low) / (finishes[high] - finishes[low]))


def stable_seed(name: str) -> int:
    """A seed from a name that is the same in every process (``hash`` of a string is not)."""
    return zlib.crc32(name.encode())
