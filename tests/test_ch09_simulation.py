"""Chapter 9's scale-out simulation (the model; its sweep's metrics) against oracles that do not come from its own code.

Queueing theory (one replica with one row and a constant step is an M/D/1 queue), hand-computed
step sums, conservation of requests, the benchmarks' own workload definitions, and the routers'
defining choices. A timing is never asserted: every figure here is simulated time.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from benchmarks.studies.scale_out_simulation.sweep import (
    DEFAULT_OUT,
    MAX_QUEUE,
    REPLICA_COUNTS,
    UTILISATIONS,
    measured_window,
    summarise,
)
from chapters.ch09_scale_out.simulation import (
    ARTICLE_PROMPT_LENGTHS,
    DEFAULT_NEW_TOKENS,
    DEFAULT_STEP_TIMES,
    MIXED_NEW_TOKENS,
    MIXES,
    ROUTERS,
    Outcome,
    ReplicaConfig,
    RequestMix,
    Requests,
    StepTimeModel,
    replica_capacity,
    route_least_tokens,
    route_pow2,
    simulate,
)
from shared.paths import REPO_ROOT

STEP_MS = 10.0
CONSTANT = StepTimeModel.constant(STEP_MS)


def fixed_requests(arrivals: list[float] | np.ndarray, prompt: int, answer: int, max_new: int | None = None) -> Requests:
    n = len(arrivals)
    return Requests(np.asarray(arrivals, dtype=float), np.full(n, prompt), np.full(n, answer), np.full(n, max_new or answer))


def poisson_requests(mix: RequestMix, rate: float, count: int, seed: int = 7) -> Requests:
    return Requests.poisson(mix, rate, count, np.random.default_rng(seed))


# -- the inputs are the benchmarks' and chapter 8's --------------------------------------------


def test_the_request_mixes_are_the_benchmarks_workloads() -> None:
    from benchmarks.harness.streaming import MIXED_MAX_NEW, MIXED_MIN_NEW
    from benchmarks.harness.workload import PROMPT_LENGTHS, WORKLOADS

    assert ARTICLE_PROMPT_LENGTHS == PROMPT_LENGTHS
    assert DEFAULT_NEW_TOKENS == WORKLOADS["default"].max_new_tokens
    assert MIXED_NEW_TOKENS == (MIXED_MIN_NEW, MIXED_MAX_NEW)
    prompts, answers, max_new = MIXES["mixed"].draw(np.random.default_rng(0), 20_000)
    assert set(prompts.tolist()) == set(PROMPT_LENGTHS)
    assert answers.min() == MIXED_MIN_NEW and answers.max() == MIXED_MAX_NEW
    # log-uniform: the median answer is the geometric mean of the bounds
    assert np.median(answers) == pytest.approx(math.sqrt(MIXED_MIN_NEW * MIXED_MAX_NEW), rel=0.05)
    assert (max_new == answers).all()
    assert (MIXES["mixed-capped"].draw(np.random.default_rng(0), 100)[2] == MIXED_MAX_NEW).all()


def test_the_replica_budgets_are_chapter_8s_defaults_and_its_rule() -> None:
    from chapters.ch04_memory_pool.server import AdmissionOptions
    from chapters.ch08_continuous_batching.scheduler import SchedulerConfig

    config = ReplicaConfig(CONSTANT)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (SchedulerConfig().max_num_seqs, SchedulerConfig().max_num_batched_tokens)
    assert MAX_QUEUE == AdmissionOptions.model_fields["max_queue"].default
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        ReplicaConfig(CONSTANT, max_num_seqs=8, max_num_batched_tokens=4)


# -- queueing theory and exact step sums ------------------------------------------------------


def test_one_row_and_a_constant_step_is_an_md1_queue() -> None:
    """max_num_seqs=1, every request 4 steps of 10 ms: service D = 40 ms, deterministic. Pollaczek-Khinchine:
    mean wait = rho * D / (2 (1 - rho)); and an arrival finds the replica idle with probability 1 - rho (PASTA)."""
    service_s, rho = 4 * STEP_MS / 1e3, 0.7
    rate = rho / service_s
    requests = fixed_requests(np.cumsum(np.random.default_rng(3).exponential(1 / rate, 40_000)), prompt=16, answer=4)
    outcome = simulate(requests, "random", 1, ReplicaConfig(CONSTANT, max_num_seqs=1))
    wait = outcome.started_s - requests.arrival_s
    assert np.allclose(outcome.finished_s - outcome.started_s, service_s)
    assert wait.mean() == pytest.approx(rho * service_s / (2 * (1 - rho)), rel=0.08)
    assert np.mean(wait == 0) == pytest.approx(1 - rho, abs=0.02)


def test_without_queueing_a_request_takes_its_steps_exactly() -> None:
    """Room for everyone (max_num_seqs large): one prefill step, then answer - 1 decode steps, whoever else runs;
    an arrival waits at most for the step under way to end."""
    mix = RequestMix("test", "", prompt_lengths=(16, 128), answer_lengths=(1, 5, 40))
    requests = poisson_requests(mix, rate=300.0, count=3000)
    outcome = simulate(requests, "random", 1, ReplicaConfig(CONSTANT, max_num_seqs=1000, max_num_batched_tokens=100_000))
    step_s = STEP_MS / 1e3
    assert np.allclose(outcome.first_token_s - outcome.started_s, step_s)
    assert np.allclose(outcome.finished_s - outcome.started_s, requests.answer_tokens * step_s)
    wait = outcome.started_s - requests.arrival_s
    assert wait.min() >= 0 and wait.max() < step_s
    assert wait.max() > 0.5 * step_s  # arrivals did land mid-step


def test_a_lone_request_takes_the_sum_of_its_steps_durations() -> None:
    """Requests far apart: a prefill step of p prompt tokens alone, then decode steps of one row that reads
    p + 1, p + 2, ... positions, each priced by the model's formula written out here."""
    model = StepTimeModel(step_intercept_ms=2.0, ms_per_decode_row=0.5, ms_per_context_token=0.01,
                          prefill_intercept_ms=1.0, prefill_ms_per_token=0.1,
                          prefill_only_intercept_ms=3.0, prefill_only_ms_per_token=0.05)
    prompt, answer = 48, 20
    expected_ms = (3.0 + 0.05 * prompt) + sum(2.0 + 0.5 + 0.01 * (prompt + j) for j in range(1, answer))
    outcome = simulate(fixed_requests([0.0, 100.0, 200.0], prompt, answer), "pow2", 2, ReplicaConfig(model))
    assert np.allclose(outcome.finished_s - outcome.requests.arrival_s, expected_ms / 1e3)


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks() -> None:
    """Budget 64 tokens: a 200-token prompt takes ceil(200 / 64) = 4 steps before its first token."""
    outcome = simulate(fixed_requests([0.0], prompt=200, answer=3), "random", 1,
                       ReplicaConfig(CONSTANT, max_num_seqs=8, max_num_batched_tokens=64))
    assert outcome.first_token_s[0] == pytest.approx(4 * STEP_MS / 1e3)
    assert outcome.finished_s[0] == pytest.approx(6 * STEP_MS / 1e3)


def test_a_full_batch_serves_max_num_seqs_over_the_answers_steps() -> None:
    """Never short of work, a constant step: each request holds a row for `answer` steps, so the replica
    finishes max_num_seqs / (answer x step) requests a second."""
    mix = RequestMix("test", "", prompt_lengths=(16,), answer_lengths=(32,))
    capacity = replica_capacity(mix, ReplicaConfig(CONSTANT, max_num_seqs=8), count=2000)
    assert capacity == pytest.approx(8 / (32 * STEP_MS / 1e3), rel=0.01)


# -- conservation and determinism --------------------------------------------------------------


@pytest.mark.parametrize("router", ROUTERS)
def test_every_request_finishes_exactly_once(router: str) -> None:
    model = StepTimeModel.from_file(REPO_ROOT / DEFAULT_STEP_TIMES)
    requests = poisson_requests(MIXES["mixed-capped"], rate=4 * 0.95 * 24, count=4000)
    outcome = simulate(requests, router, 4, ReplicaConfig(model))
    assert not np.isnan(outcome.finished_s).any()
    assert (requests.arrival_s <= outcome.started_s).all()
    assert (outcome.started_s < outcome.first_token_s).all() and (outcome.first_token_s <= outcome.finished_s).all()
    assert outcome.replica_finished.tolist() == np.bincount(outcome.replica, minlength=4).tolist()
    assert outcome.replica_finished.sum() == len(requests)
    # the routers' counters come back to nothing: every token counted at arrival was computed or given back
    assert not outcome.final_in_flight.any() and not outcome.final_tokens_left.any() and not outcome.final_budget_left.any()


def test_a_seed_makes_the_run_reproducible() -> None:
    requests = poisson_requests(MIXES["mixed"], rate=200.0, count=3000)
    config = ReplicaConfig(StepTimeModel.from_file(REPO_ROOT / DEFAULT_STEP_TIMES))
    first, again = simulate(requests, "pow2", 8, config, seed=5), simulate(requests, "pow2", 8, config, seed=5)
    other = simulate(requests, "pow2", 8, config, seed=6)
    assert np.array_equal(first.replica, again.replica) and np.array_equal(first.finished_s, again.finished_s)
    assert not np.array_equal(first.replica, other.replica)


# -- the routers ---------------------------------------------------------------------------------


def test_pow2_takes_the_less_loaded_of_its_two_draws() -> None:
    """One idle replica among three busy ones: it is among two distinct draws half the time, and then wins."""
    choose = route_pow2(4, np.random.default_rng(0), 4000)
    in_flight = [9, 9, 0, 9]
    picks = np.array([choose(i, in_flight, [0] * 4) for i in range(4000)])
    assert np.mean(picks == 2) == pytest.approx(0.5, abs=0.03)


def test_least_tokens_takes_the_fewest_tokens_and_spreads_ties() -> None:
    choose = route_least_tokens(4, np.random.default_rng(0), 400)
    picks = {choose(i, [0] * 4, [50, 7, 7, 90]) for i in range(400)}
    assert picks == {1, 2}


def test_least_remaining_sees_progress_and_least_tokens_does_not() -> None:
    """A: 100 tokens, 95 made by t = 0.953 s (5 left, budget 116). B: just arrived on the other replica
    (30 left, budget 30). C arrives mid-step: least-remaining sends it beside A, least-tokens beside B."""
    requests = Requests(np.array([0.0, 0.953, 0.957]), np.array([16, 16, 16]), np.array([100, 14, 4]), np.array([100, 14, 4]))
    for router, beside in (("least-remaining", 0), ("least-tokens", 1)):
        outcome = simulate(requests, router, 2, ReplicaConfig(CONSTANT))
        assert outcome.replica[0] != outcome.replica[1]
        assert outcome.replica[2] == outcome.replica[beside], router


def _simulated(router: str, mix: RequestMix, replicas: int, utilisation: float, count: int = 12_000) -> tuple[Outcome, dict]:
    """One point on the committed step model: the outcome and its summary (the same arrivals for every router)."""
    config = ReplicaConfig(StepTimeModel.from_file(REPO_ROOT / DEFAULT_STEP_TIMES))
    capacity = replica_capacity(mix, config, count=1500)
    requests = poisson_requests(mix, rate=replicas * utilisation * capacity, count=count)
    measured, window = measured_window(requests, warmup_s=5.0)
    outcome = simulate(requests, router, replicas, config, seed=11, window=window)
    return outcome, summarise(outcome, measured, window, config.max_num_seqs)


def test_at_low_load_every_router_gives_the_same_latencies() -> None:
    """At 0.2 % of capacity hardly two requests meet on a replica, so where they go hardly matters: the mean
    and the P90 agree to a per cent (the P99 is where the few that do meet under random go)."""
    outcomes = {router: _simulated(router, MIXES["default"], 8, 0.002, count=1500) for router in ROUTERS}
    latencies = [o.finished_s - o.requests.arrival_s for o, _ in outcomes.values()]
    means, p90s = [float(np.mean(x)) for x in latencies], [float(np.percentile(x, 90)) for x in latencies]
    assert max(means) <= 1.01 * min(means) and max(p90s) <= 1.01 * min(p90s)


BIMODAL = RequestMix("bimodal", "short and long answers", prompt_lengths=(16, 64), answer_lengths=(8, 256),
                     answer_weights=(0.8, 0.2))


@pytest.mark.parametrize("router", ["least-tokens", "least-remaining", "pow2"])
def test_a_load_aware_router_beats_random_on_p99_at_high_load(router: str) -> None:
    """Short and long answers at 95 % of capacity on 8 replicas: random piles long answers onto some
    replicas (every step there slows, and requests queue); counting what each replica holds does not."""
    (_, aware), (_, blind) = _simulated(router, BIMODAL, 8, 0.95), _simulated("random", BIMODAL, 8, 0.95)
    assert aware["latency_ms"]["p99"] < 0.9 * blind["latency_ms"]["p99"]
    assert aware["ttft_ms"]["p99"] < 0.5 * blind["ttft_ms"]["p99"]


# -- the metrics -----------------------------------------------------------------------------


def test_goodput_counts_the_requests_within_both_slos() -> None:
    """Four requests in a 2-second window: within both SLOs, first token late, tokens slow, within both."""
    requests = fixed_requests([0.0, 0.5, 1.0, 2.0], prompt=16, answer=11)
    first = np.array([0.1, 2.0, 1.1, 2.1])
    finished = first + np.array([0.5, 0.5, 1.5, 0.9])  # 10 later tokens: 50, 50, 150, 90 ms each
    outcome = Outcome(requests, np.zeros(4, dtype=np.int64), requests.arrival_s.copy(), first, finished,
                      np.zeros(4, dtype=np.int64), np.array([1.0]), np.array([8.0]), np.array([4]), np.zeros(1), np.zeros(1),
                      np.zeros(1), 0, (0.0, 2.0))
    summary = summarise(outcome, slice(0, 4), (0.0, 2.0), max_num_seqs=8)
    assert summary["goodput_share"] == 0.5 and summary["goodput_rps"] == 1.0
    assert summary["busy_fraction"]["mean"] == 0.5 and summary["batch_occupancy"]["mean"] == 0.5


# -- the committed results ---------------------------------------------------------------------


def test_the_committed_sweep_says_what_it_assumes_and_covers_every_point() -> None:
    document = json.loads((REPO_ROOT / DEFAULT_OUT).read_text())
    assert document["seed"] and document["inputs"]["step_times"] == str(DEFAULT_STEP_TIMES)
    assert len(document["assumptions"]) >= 8 and all(isinstance(s, str) and s.endswith(".") for s in document["assumptions"])
    keys = {(p["mix"], p["router"], p["replicas"], p["utilisation"]) for p in document["points"]}
    assert keys == {(m, r, n, u) for m in MIXES for r in ROUTERS for n in REPLICA_COUNTS for u in UTILISATIONS}
    one_replica = [p for p in document["points"] if p["replicas"] == 1]
    for mix in MIXES:  # with one replica there is nothing to choose: every router, the same figures
        for u in UTILISATIONS:
            assert len({json.dumps({k: v for k, v in p.items() if k != "router"}) for p in one_replica
                        if p["mix"] == mix and p["utilisation"] == u}) == 1


def test_plot_scaling_draws_a_line_per_router_on_both_axes() -> None:
    from matplotlib.figure import Figure

    from benchmarks.report.scale_out_simulation_plots import plot_scaling

    document = json.loads((REPO_ROOT / DEFAULT_OUT).read_text())
    ax_p99, ax_goodput = Figure().subplots(1, 2)
    plot_scaling(document, ax_p99, ax_goodput, mix="mixed", utilisation=0.95)
    assert len(ax_p99.get_lines()) == 2 * len(ROUTERS)  # answer P99 and TTFT P99
    assert len(ax_goodput.get_lines()) == len(ROUTERS) + 1  # and the offered rate
    assert [len(line.get_xdata()) for line in ax_goodput.get_lines()] == [len(REPLICA_COUNTS)] * (len(ROUTERS) + 1)
    with pytest.raises(ValueError):
        plot_scaling(document, ax_p99, ax_goodput, mix="mixed", utilisation=0.42)
