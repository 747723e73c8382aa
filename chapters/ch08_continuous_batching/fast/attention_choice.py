"""Which attention backend serves: the one named (``--attention``), or for ``auto`` the one :data:`RULE` picks on this machine.

A faster backend replaces a simpler one only if it wins by :data:`MARGIN`; the outcome is cached per machine and settings."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Literal

from chapters.ch08_continuous_batching.fast.attention_flex import FlexAttention
from chapters.ch08_continuous_batching.attention_gather import GatherAttention
from chapters.ch08_continuous_batching.fast.attention_kernel import KernelAttention
from chapters.ch08_continuous_batching.model_runner import prepare_inputs
from chapters.ch08_continuous_batching.paged_attention import PackedInputs, PagedAttention
from chapters.ch08_continuous_batching.paged_cache import PagedKVStore
from chapters.ch08_continuous_batching.scheduler import ScheduledRow, Sequence
from chapters.ch08_continuous_batching.fast.startup_cache import choose_once, machine_key, model_key, pick_within_margin, round_order
from shared.devices import synchronize
from shared.model import DecoderModel

log = logging.getLogger(__name__)

BACKENDS: dict[str, type[PagedAttention]] = {"gather": GatherAttention, "flex": FlexAttention, "kernel": KernelAttention}
ATTENTION_CHOICES = Literal["auto", "gather", "flex", "kernel"]

RULE = (
    "Time one packed decode step of the model (max_num_seqs sequences, their contexts spread evenly over "
    "PROBE_CONTEXTS as served traffic spreads them, blocks scattered over the pool) with every backend that "
    "can run here, PROBE_ROUNDS rounds taking turns (each round starting with the next backend). Going down "
    "PREFERENCE, a backend replaces the choice so far only if the median of its same-round time ratios to it "
    "beats it by MARGIN."
)
# On a GPU a small model's decode step costs more in launches than in arithmetic: the step must be recorded, and only flex's can.
GPU_RULE = "on a GPU, the one backend whose decode step can be recorded as CUDA graphs (gather's shapes change every step)"
# Rows of different contexts, as requests have (one length hides what padding costs gather); rounds enough for a robust median.
PROBE_CONTEXTS, PROBE_ROUNDS = (32, 256), 9
MARGIN = 0.10  # what a faster backend must win by to replace a simpler one: a smaller win could flip between starts
PREFERENCE = ("gather", "kernel", "flex")  # simplest first: plain PyTorch, one C function, TorchInductor's compile per bucket


def build_attention(name: str, store: PagedKVStore) -> PagedAttention:
    """Backend ``name`` (not ``auto``) over ``store``; ValueError saying why when it cannot run here."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(BACKENDS)}")
    reason = BACKENDS[name].unavailable_reason()
    if reason:
        raise ValueError(f"attention {name} cannot run here: {reason}")
    return BACKENDS[name](store)


def choose_attention(name: str, store: PagedKVStore, model: DecoderModel, max_num_seqs: int, remeasure: bool = False) -> PagedAttention:
    """The backend ``name`` names, or for ``auto`` the one :data:`RULE` picks (cached), warmed up (compiled) on every bucket."""
    if name == "auto" and store.device.type == "cuda":  # GPU_RULE
        log.info("decode attention: flex (%s)", GPU_RULE)
        name = "flex"
    chosen = build_attention(name, store) if name != "auto" else _by_the_rule(store, model, max_num_seqs, remeasure)
    rows = 1
    while rows < max_num_seqs:
        rows *= 2
        measure_decode_steps(model, store, {chosen.name: chosen}, min(rows, max_num_seqs), rounds=0)
    return chosen


def _by_the_rule(store: PagedKVStore, model: DecoderModel, max_num_seqs: int, remeasure: bool = False) -> PagedAttention:
    names = [name for name in BACKENDS if name == "gather" or not _unavailable(name)]
    key = {**machine_key(), **model_key(model), "kv": str(store.pool.storage.dtype), "device": str(store.device),
           "block_tokens": store.block_tokens, "blocks": store.manager.total_blocks, "rows": max_num_seqs,
           "candidates": names, "rule": [RULE, PROBE_CONTEXTS, PROBE_ROUNDS, MARGIN, PREFERENCE]}
    chosen = choose_once("attention", key, lambda: _measure(store, model, max_num_seqs, names), remeasure)
    return build_attention(chosen, store)


def _unavailable(name: str) -> str | None:
    if reason := BACKENDS[name].unavailable_reason():  # no compiler here: the user can install one
        log.warning("attention %s cannot run here: %s", name, reason)
    return reason


def _measure(store: PagedKVStore, model: DecoderModel, max_num_seqs: int, names: list[str]) -> dict:
    log.info("decode attention: no measured choice for this machine and these settings; building %s (compiled at a first "
             "start, then cached)", ", ".join(names))
    candidates = {}
    for name in names:
        try:
            candidates[name] = build_attention(name, store)
        except ValueError as error:  # the kernel on a GPU pool, flex with a block size it cannot take
            log.warning("%s", error)
    samples = measure_decode_steps(model, store, candidates, max_num_seqs, leave_out_failing=True) if len(candidates) > 1 else {}
    return pick_within_margin(samples or {"gather": [0.0]}, PREFERENCE, MARGIN)


def scattered_decode_inputs(store: PagedKVStore, contexts: list[int], rng: random.Random) -> tuple[PackedInputs, list[Sequence]]:
    """One packed decode step, prepared as a served one, of new sequences holding ``contexts`` positions; their blocks come from
    ``store``, each table shuffled as a busy pool scatters them, and the caller frees them."""
    seqs = [Sequence([0] * context, 1) for context in contexts]
    for seq in seqs:
        store.manager.allocate(seq.seq_id, len(seq.token_ids))
        rng.shuffle(store.manager.tables[seq.seq_id])  # its own blocks, in another order
    rows = [ScheduledRow(seq, len(seq.token_ids) - 1, 1) for seq in seqs]
    return prepare_inputs(store, rows, len(rows)), seqs


def measure_decode_steps(model: DecoderModel, store: PagedKVStore, backends: dict[str, PagedAttention], sequences: int,
                         rounds: int = PROBE_ROUNDS, leave_out_failing: bool = False) -> dict[str, list[float]]:
    """Seconds of one packed decode step of ``sequences`` rows through each backend, per round, taking turns after two unmeasured
    steps each; with ``leave_out_failing`` a backend other than ``gather`` whose first step raises is left out with a warning."""
    manager, rng = store.manager, random.Random(0)
    shortest, longest = min(PROBE_CONTEXTS[0], store.config.n_ctx), min(PROBE_CONTEXTS[1], store.config.n_ctx)
    sequences = max(1, min(sequences, manager.free_blocks // manager.blocks_for(longest)))
    contexts = [shortest + (longest - shortest) * i // max(1, sequences - 1) for i in range(sequences)]
    inputs, seqs = scattered_decode_inputs(store, contexts, rng)
    try:
        def step_of(backend: PagedAttention) -> Callable[[], None]:
            def step() -> None:
                model.forward_packed(inputs.input_ids, inputs.positions, backend.bind(inputs), inputs.logits_indices)
                synchronize(store.device)  # on a GPU: time the step, not its launch
            return step

        steps = {name: step_of(backend) for name, backend in backends.items()}
        for name, step in list(steps.items()):
            try:
                step()
            except Exception as error:  # any failure to build or run a compiled backend here
                if not leave_out_failing or name == "gather":
                    raise
                log.warning("attention %s left out: its first step failed here: %s", name, str(error).strip().splitlines()[0])
                del steps[name]
        if rounds:
            started = time.perf_counter()
            for step in steps.values():
                step()
            log.info("measuring decode attention: %s, %d rounds of one %d-row step each, about %.0f s",
                     ", ".join(steps), rounds, sequences, rounds * (time.perf_counter() - started))
        samples: dict[str, list[float]] = {name: [] for name in steps}
        for index in range(rounds):
            for name in round_order(list(steps), index):
                started = time.perf_counter()
                steps[name]()
                samples[name].append(time.perf_counter() - started)
        return samples
    finally:
        for seq in seqs:
            manager.free(seq.seq_id)
