"""Continuous batching: a scheduler that plans each step of chapter 3's loop (schedule, execute, update) anew.

Each plan (:meth:`ContinuousScheduler.schedule`): every running sequence whose prompt is computed decodes one token (under
``grow`` the newest is preempted by recompute while no block is free); partly computed prompts get their next chunk within the
token budget; waiting sequences are admitted first come first served while a row, budget and blocks are left (``reserve``:
blocks for their whole life; ``grow``: for their first chunk). :meth:`~ContinuousScheduler.update` appends the sampled tokens
and frees a finished sequence's blocks at once. No threads or asyncio: a :class:`SequenceListener` hears of tokens and ends."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal, Protocol

from torch import Tensor

from chapters.ch08_continuous_batching.block_manager import OutOfBlocks
from chapters.ch08_continuous_batching.paged_cache import PagedKVStore
from chapters.ch08_continuous_batching.sampling import sample_tokens
from chapters.ch08_continuous_batching.sequence import Sequence, Status, StopCondition  # noqa: F401 (StopCondition: for importers)

KVPolicy = Literal["reserve", "grow"]


class SequenceListener(Protocol):
    def on_token(self, seq: Sequence, token: int) -> None: ...

    def on_finished(self, seq: Sequence) -> None: ...


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences running at once (rows of a decode call)
    max_num_batched_tokens: int = 512  # tokens computed in one step: decodes + prefill chunks
    kv_policy: KVPolicy = "grow"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs}): "
                "every running sequence must be able to decode in every step"
            )
        if self.kv_policy not in ("reserve", "grow"):
            raise ValueError(f"kv_policy must be reserve or grow, got {self.kv_policy!r}")


@dataclass(frozen=True)
class ScheduledRow:
    """``length`` tokens of ``seq`` from position ``start``; ``samples``: this row's logits give its next token."""

    seq: Sequence
    start: int
    length: int

    @property
    def new_ids(self) -> list[int]:
        return self.seq.token_ids[self.start : self.start + self.length]

    @property
    def samples(self) -> bool:
        return self.start + self.length == len(self.seq.token_ids)


@dataclass
class SchedulerStats:
    steps: int = 0
    tokens_computed: int = 0  # prompt (and recomputed) positions + decode positions
    decode_tokens: int = 0
    prefill_tokens: int = 0
    tokens_generated: int = 0
    preemptions: int = 0
    finished: int = 0
    aborted: int = 0


class StepRunner(Protocol):
    """What computes a step: the model runner, or a test's fake."""

    def execute(self, rows: list[ScheduledRow], num_decodes: int) -> Tensor:
        """float32 logits (R, V) of the rows that sample, in row order."""
        ...


@dataclass(frozen=True)
class ContinuousStep:
    """One step's plan, plain data: rows with one new token each (decodes) first, then prompt chunks."""

    decode_rows: list[ScheduledRow]
    prefill_rows: list[ScheduledRow]

    @property
    def rows(self) -> list[ScheduledRow]:
        return self.decode_rows + self.prefill_rows

    @property
    def num_tokens(self) -> int:
        return len(self.decode_rows) + sum(row.length for row in self.prefill_rows)

    def execute(self, runner: StepRunner) -> Tensor:
        """Every row in ONE packed call (chapter 3's loop calls this with the model runner)."""
        return runner.execute(self.rows, len(self.decode_rows))


class ContinuousScheduler:
    def __init__(
        self,
        store: PagedKVStore,
        config: SchedulerConfig,
        listener: SequenceListener | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.store, self.config = store, config
        self.manager = store.manager
        self.listener = listener
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest admission first
        self.stats = SchedulerStats()
        longest = store.config.n_ctx
        if self.manager.blocks_for(longest) > self.manager.total_blocks:
            raise ValueError(f"the pool's {self.manager.total_blocks} blocks cannot hold one sequence of {longest} positions")

    def add(self, seq: Sequence) -> None:
        if len(seq.prompt_ids) + seq.max_new_tokens > self.store.config.n_ctx:
            raise ValueError(f"{len(seq.prompt_ids)} + {seq.max_new_tokens} tokens exceed the context of {self.store.config.n_ctx}")
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> bool:
        """Drop ``seq`` wherever it is; its blocks are free when this returns. False if it was not here."""
        if seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.manager.free(seq.seq_id)
        else:
            return False
        seq.status = Status.ABORTED
        self.stats.aborted += 1
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ContinuousStep | None:
        decode_rows = self._schedule_decodes()
        continuing, budget = self._continue_prefills(self.config.max_num_batched_tokens - len(decode_rows))
        admitted, budget = self._admit(budget)
        prefill_rows = continuing + admitted
        if not decode_rows and not prefill_rows:
            return None
        now = self.clock()
        for row in decode_rows + prefill_rows:
            if row.seq.scheduled_at is None:
                row.seq.scheduled_at = now
        return ContinuousStep(decode_rows, prefill_rows)

    def _schedule_decodes(self) -> list[ScheduledRow]:
        rows: list[ScheduledRow] = []
        for seq in list(self.running):  # a copy: making room preempts from the tail
            if seq.status is not Status.RUNNING or seq.num_computed < len(seq.token_ids) - 1:
                continue  # preempted by an earlier row of this step, or still prefilling (pass 2)
            if self._make_room(seq, len(seq.token_ids)):  # False: seq itself, the newest, was preempted
                rows.append(ScheduledRow(seq, seq.num_computed, 1))
        return rows

    def _make_room(self, seq: Sequence, n_tokens: int) -> bool:
        """Blocks for ``n_tokens`` positions of a running ``seq``, preempting the newest while short; False when ``seq``
        itself went. Decodes only: the victims come from the tail of ``running``, past every earlier decode row of this step."""
        if self.manager.can_grow_to(seq.seq_id, n_tokens):  # the common case: no one is preempted
            self.manager.grow_to(seq.seq_id, n_tokens)
            return True
        return self._preempt_for(seq, n_tokens)

    def _preempt_for(self, seq: Sequence, n_tokens: int) -> bool:
        """Preempt the newest running sequences until ``seq`` can grow to ``n_tokens``, then grow it; False if ``seq`` went."""
        # EXERCISE ch08.3 BEGIN "preemption by recompute: free the newest sequence's blocks while short"
        while not self.manager.can_grow_to(seq.seq_id, n_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        self.manager.grow_to(seq.seq_id, n_tokens)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and put it back at the head of the queue; it keeps its tokens and recomputes them later."""
        # EXERCISE ch08.3 BEGIN "preemption by recompute: free the newest sequence's blocks while short"
        self.running.remove(seq)
        self.manager.free(seq.seq_id)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(seq)

    def _continue_prefills(self, budget: int) -> tuple[list[ScheduledRow], int]:
        rows: list[ScheduledRow] = []
        for seq in self.running:
            remaining = len(seq.token_ids) - seq.num_computed
            if remaining <= 1 or budget <= 0:
                continue  # one position left: pass 1 computed it (a decode, or a prompt's last token)
            chunk = min(remaining, budget, self._room_for(seq))  # never preempt for a prefill
            if chunk <= 0:
                continue
            self.manager.grow_to(seq.seq_id, seq.num_computed + chunk)
            rows.append(ScheduledRow(seq, seq.num_computed, chunk))
            budget -= chunk
        return rows, budget

    def _room_for(self, seq: Sequence) -> int:
        """Positions beyond ``num_computed`` that ``seq``'s table plus the free blocks can hold."""
        m = self.manager
        return (len(m.tables[seq.seq_id]) + m.free_blocks) * m.block_tokens - seq.num_computed

    def _admit(self, budget: int) -> tuple[list[ScheduledRow], int]:
        """:meth:`_admit_in_order` over the queue less those :meth:`_held_for_prefixes_in_flight`, who keep their places."""
        order, held = self.waiting, self._held_for_prefixes_in_flight()
        self.waiting = deque(seq for seq in order if seq not in held)
        rows, budget = self._admit_in_order(budget)
        self.waiting = deque(seq for seq in order if seq.status is Status.WAITING)  # less those admitted
        return rows, budget

    def _held_for_prefixes_in_flight(self) -> set[Sequence]:
        """Waiting sequences whose first uncached full block a running prompt, or one admitted before them, computes: a block
        is found only once computed, so each waits a step or two and finds it cached instead of computing it again."""
        m, held, rows_left = self.manager, set(), self.config.max_num_seqs - len(self.running)
        claimed = {m.cached_prefix(seq.token_ids).missing for seq in self.running if seq.num_computed < len(seq.token_ids) - 1}
        for seq in self.waiting if m.prefix_caching else ():  # only as far as this step can admit
            if rows_left <= 0:
                break
            missing = m.cached_prefix(seq.token_ids).missing  # what it would compute first
            if missing is not None and missing in claimed:
                held.add(seq)
            else:
                rows_left -= 1
            claimed.add(missing)
        return held

    def _admit_in_order(self, budget: int) -> tuple[list[ScheduledRow], int]:
        """Waiting sequences, oldest first, while a row, budget and blocks are left (no skipping ahead)."""
        rows: list[ScheduledRow] = []
        # EXERCISE ch08.2 BEGIN "admission under max_num_seqs and the token budget, chunking long prompts"
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            cached = self.manager.cached_prefix(seq.token_ids)  # full blocks already computed (prefix caching; else none)
            chunk = min(len(seq.token_ids) - cached.tokens, budget)  # the rest: new, or preempted (0 computed)
            wanted = seq.peak_kv_tokens if self.config.kv_policy == "reserve" else cached.tokens + chunk
            try:
                self.manager.allocate(seq.seq_id, wanted, cached)
            except OutOfBlocks:
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            seq.num_computed = cached.tokens
            seq.status = Status.RUNNING
            self.running.append(seq)
            rows.append(ScheduledRow(seq, seq.num_computed, chunk))
            budget -= chunk
        # EXERCISE ch08.2 END
        return rows, budget

    def update(self, step: ContinuousStep, logits: Tensor) -> None:
        """``logits``: one row per SAMPLING row of ``step``, in row order."""
        sampling = [row.seq for row in step.rows if row.samples]
        tokens, logprobs = sample_tokens(logits, [seq.sampling for seq in sampling], [seq.generator for seq in sampling])
        next_ids, next_logprobs = iter(tokens), iter(logprobs)
        now, s = self.clock(), self.stats
        s.steps += 1
        s.tokens_computed += step.num_tokens
        s.decode_tokens += len(step.decode_rows)
        s.prefill_tokens += step.num_tokens - len(step.decode_rows)
        for row in step.rows:
            seq = row.seq
            samples = row.samples  # before the token is appended
            seq.num_computed = row.start + row.length
            self.manager.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed)  # findable once computed
            if not samples:
                continue  # a partial prompt chunk: no logits were computed for it
            token, token_logprobs = next(next_ids), next(next_logprobs)
            seq.token_ids.append(token)
            if token_logprobs is not None:
                seq.logprobs.append(token_logprobs)
            self.stats.tokens_generated += 1
            if seq.first_token_at is None:
                seq.first_token_at = now
            if self.listener is not None:
                self.listener.on_token(seq, token)
            if seq.stop is not None and seq.stop.reached(seq.output_ids):
                seq.finish_reason = "stop"
            elif seq.num_generated >= seq.max_new_tokens:
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                self._retire(seq, now)

    def _retire(self, seq: Sequence, now: float) -> None:
        self.running.remove(seq)
        self.manager.free(seq.seq_id)
        seq.status = Status.FINISHED
        seq.finished_at = now
        self.stats.finished += 1
        if self.listener is not None:
            self.listener.on_finished(seq)

    def describe(self) -> dict:
        """The scheduler's figures for ``/stats``: its knobs, its queues, the pool's blocks, its counters."""
        m, steps = self.manager, self.stats.steps
        return {**asdict(self.config), "running": len(self.running), "waiting": len(self.waiting),
                "blocks_total": m.total_blocks, "blocks_used": m.used_blocks, "blocks_free": m.free_blocks,
                "block_tokens": m.block_tokens, **asdict(self.stats),
                "tokens_per_step": round(self.stats.tokens_computed / steps, 3) if steps else None,
                "prefix_cache": m.describe_prefix_cache()}
