"""Which attention backend serves: the one named (``--attention``), or for ``auto`` the one measured fastest here.

Chapter 5 picks its engine by timing the candidates on this machine; this chapter picks its decode
attention the same way, once, at start-up (:data:`RULE`): every backend that can run here computes
the same packed decode step, taking turns, and the fastest serves if it clearly beats ``gather``,
the readable one. The backends: :mod:`~chapters.ch08_continuous_batching.attention_gather`,
:mod:`~chapters.ch08_continuous_batching.attention_flex`,
:mod:`~chapters.ch08_continuous_batching.attention_kernel`.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Literal

from chapters.ch08_continuous_batching.attention_flex import FlexAttention
from chapters.ch08_continuous_batching.attention_gather import GatherAttention
from chapters.ch08_continuous_batching.attention_kernel import KernelAttention
from chapters.ch08_continuous_batching.model_runner import prepare_inputs
from chapters.ch08_continuous_batching.paged_attention import PackedInputs, PagedAttention
from chapters.ch08_continuous_batching.paged_cache import PagedKVStore
from chapters.ch08_continuous_batching.scheduler import ScheduledRow, Sequence
from shared.model import GPT

log = logging.getLogger(__name__)

BACKENDS: dict[str, type[PagedAttention]] = {"gather": GatherAttention, "flex": FlexAttention, "kernel": KernelAttention}
ATTENTION_CHOICES = Literal["auto", "gather", "flex", "kernel"]

RULE = (
    "Time one packed decode step of the model (max_num_seqs sequences, their contexts spread evenly over "
    "PROBE_CONTEXTS as served traffic spreads them, blocks scattered over the pool) with every backend that "
    "can run here, taking turns for PROBE_REPEATS rounds, median per backend; serve the fastest if it beats "
    "gather by MIN_SPEEDUP, else gather (the readable one)."
)
# Contexts of one length would hide what padding costs gather: the probe's rows differ, as requests do.
PROBE_CONTEXTS, PROBE_REPEATS, MIN_SPEEDUP = (32, 256), 7, 1.10


def build_attention(name: str, store: PagedKVStore) -> PagedAttention:
    """Backend ``name`` (not ``auto``) over ``store``; ValueError saying why when it cannot run here."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(BACKENDS)}")
    reason = BACKENDS[name].unavailable_reason()
    if reason:
        raise ValueError(f"attention {name} cannot run here: {reason}")
    return BACKENDS[name](store)


def choose_attention(name: str, store: PagedKVStore, model: GPT, max_num_seqs: int) -> PagedAttention:
    """The backend ``name`` names, or for ``auto`` the one :data:`RULE` picks on this machine; warmed up.

    Warm-up runs a decode step of every batch size bucket up to ``max_num_seqs`` (16, 32, 64, ...),
    so a compiled backend compiles now, not under the first requests.
    """
    chosen = build_attention(name, store) if name != "auto" else _by_the_rule(store, model, max_num_seqs)
    rows = 1
    while rows < max_num_seqs:
        rows *= 2
        measure_decode_steps(model, store, {chosen.name: chosen}, min(rows, max_num_seqs), repeats=0)
    return chosen


def _by_the_rule(store: PagedKVStore, model: GPT, max_num_seqs: int) -> PagedAttention:
    candidates = {}
    for name in BACKENDS:
        try:
            candidates[name] = build_attention(name, store)
        except ValueError as error:  # no compiler here, or the kernel on a GPU pool
            log.warning("%s", error)
    if len(candidates) == 1:
        return candidates["gather"]
    timings = measure_decode_steps(model, store, candidates, max_num_seqs, leave_out_failing=True)
    best = min(timings, key=timings.get)
    chosen = best if timings[best] * MIN_SPEEDUP <= timings["gather"] else "gather"
    log.info("attention %s, by the rule over: %s", chosen, ", ".join(f"{n} {t * 1e3:.1f} ms/step" for n, t in timings.items()))
    return candidates[chosen]


def scattered_decode_inputs(store: PagedKVStore, contexts: list[int], rng: random.Random) -> tuple[PackedInputs, list[Sequence]]:
    """One packed decode step of new sequences whose histories hold ``contexts`` positions (the new token's included).

    Their blocks come from ``store`` (the caller frees them: ``store.manager.free(seq.seq_id)``), each
    table shuffled, as a busy pool scatters blocks: real tables are not runs of consecutive blocks.
    The inputs are prepared as a served step's are. The probe, the attention benchmark and the tests
    build their steps here.
    """
    seqs = [Sequence([0] * context, 1) for context in contexts]
    for seq in seqs:
        store.manager.allocate(seq.seq_id, len(seq.token_ids))
        rng.shuffle(store.manager.tables[seq.seq_id])  # its own blocks, in another order
    rows = [ScheduledRow(seq, len(seq.token_ids) - 1, 1) for seq in seqs]
    return prepare_inputs(store, rows, len(rows)), seqs


def measure_decode_steps(model: GPT, store: PagedKVStore, backends: dict[str, PagedAttention], sequences: int,
                         repeats: int = PROBE_REPEATS, leave_out_failing: bool = False) -> dict[str, float]:
    """Median seconds of one packed decode step of ``sequences`` rows through each backend (the rule's probe).

    The backends take turns, one step each per round, after one unmeasured step each (compilation,
    first touch): a machine that slows down for a moment slows every candidate's round alike, instead
    of all the samples of one of them. The probe's sequences take blocks from the store, scattered as a
    busy pool scatters them, and give them back before this returns. With ``leave_out_failing`` a backend
    other than ``gather`` whose first step raises (a compiler that cannot build its code on this machine)
    is left out of the answer with a warning, instead of ending the start.
    """
    manager, rng = store.manager, random.Random(0)
    shortest, longest = min(PROBE_CONTEXTS[0], store.config.n_ctx), min(PROBE_CONTEXTS[1], store.config.n_ctx)
    sequences = max(1, min(sequences, manager.free_blocks // manager.blocks_for(longest)))
    contexts = [shortest + (longest - shortest) * i // max(1, sequences - 1) for i in range(sequences)]
    inputs, seqs = scattered_decode_inputs(store, contexts, rng)
    try:
        steps = {name: (lambda backend=backend: model.forward_packed(inputs.input_ids, inputs.positions, backend.bind(inputs),
                                                                     inputs.logits_indices))
                 for name, backend in backends.items()}
        for name, step in list(steps.items()):
            try:
                step()
            except Exception as error:  # any failure to build or run a compiled backend here
                if not leave_out_failing or name == "gather":
                    raise
                log.warning("attention %s left out: its first step failed here: %s", name, str(error).strip().splitlines()[0])
                del steps[name]
        samples: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(repeats):
            for name, step in steps.items():
                started = time.perf_counter()
                step()
                samples[name].append(time.perf_counter() - started)
        return {name: sorted(times)[len(times) // 2] if times else 0.0 for name, times in samples.items()}
    finally:
        for seq in seqs:
            manager.free(seq.seq_id)
