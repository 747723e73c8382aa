"""Chapter 8's start-up rule: right under noise, measured once per machine and settings, and saying what it does.

The noise tests inject step timings (no clock): a candidate's true step time, times what a loaded
machine did to the moment it ran, in the order :func:`round_order` runs the candidates. The oracle
is the true times: whatever the load did, the choice is never slower than another candidate by more
than :data:`MARGIN`. The cache tests count calls of the measurement.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
from collections.abc import Callable

import pytest
import torch

from chapters.ch08_continuous_batching.fast import attention_choice, startup_cache
from chapters.ch08_continuous_batching.fast.attention_choice import MARGIN, PREFERENCE, PROBE_ROUNDS
from chapters.ch08_continuous_batching.fast.startup_cache import (
    choose_once,
    measured_once,
    pick_within_margin,
    quiet_unactionable_warnings,
    round_order,
    use_cache_for_compilers,
)
from tests.test_ch08_scheduler import fake_setup

# True step times (seconds) of the candidates: the clear case (the kernel wins, flex far behind, gather
# slowest, as on the machines measured), a near tie inside the margin, and one where gather is within it.
TRUE_TIMES = [
    {"gather": 5.0, "kernel": 1.0, "flex": 1.3},
    {"gather": 5.0, "kernel": 1.0, "flex": 0.95},
    {"gather": 1.0, "kernel": 0.95, "flex": 1.25},
]


def timed_rounds(true: dict[str, float], load: Callable[[int], float], rounds: int = PROBE_ROUNDS) -> dict[str, list[float]]:
    """What the probe would record: each step's true time times ``load(k)``, k the step's place in the run order."""
    names, samples, k = list(true), {name: [] for name in true}, 0
    for index in range(rounds):
        for name in round_order(names, index):
            samples[name].append(true[name] * load(k))
            k += 1
    return samples


def assert_within_margin(true: dict[str, float], samples: dict[str, list[float]], what: str) -> None:
    chosen = pick_within_margin(samples, PREFERENCE, MARGIN)["chosen"]
    assert true[chosen] <= min(true.values()) * (1 + MARGIN) + 1e-12, f"{what}: chose {chosen} ({true})"


def noisy_minutes(steps: int) -> list[tuple[str, Callable[[int], float]]]:
    """Loads a shared machine puts on a probe: one burst anywhere, of any length, 3x or 5x; two bursts; a ramp."""
    loads = []
    for factor in (3.0, 5.0):
        for start in range(steps):
            for length in range(1, steps - start + 1):
                loads.append((f"{factor}x burst at {start} for {length}",
                              lambda k, s=start, n=length, f=factor: f if s <= k < s + n else 1.0))
    for first in range(0, steps, 4):
        for second in range(first + 5, steps, 4):
            loads.append((f"3x bursts at {first} and {second} for 4",
                          lambda k, a=first, b=second: 3.0 if a <= k < a + 4 or b <= k < b + 4 else 1.0))
    loads.append(("ramp from 1x to 3x", lambda k: 1.0 + 2.0 * k / steps))
    return loads


@pytest.mark.parametrize("true", TRUE_TIMES, ids=["clear", "near-tie", "gather-close"])
def test_a_noisy_minute_cannot_make_the_rule_pick_a_backend_slower_than_another_by_more_than_the_margin(true) -> None:
    steps = PROBE_ROUNDS * len(true)
    for what, load in noisy_minutes(steps):
        assert_within_margin(true, timed_rounds(true, load), what)


def test_jitter_on_every_step_as_well_as_a_burst_leaves_the_clear_choice_alone() -> None:
    true, rng = TRUE_TIMES[0], random.Random(7)
    for trial in range(200):
        jitter = [math.exp(rng.gauss(0.0, 0.05)) for _ in range(PROBE_ROUNDS * 3)]
        start = rng.randrange(len(jitter))
        samples = timed_rounds(true, lambda k: jitter[k] * (4.0 if start <= k < start + 9 else 1.0))
        assert pick_within_margin(samples, PREFERENCE, MARGIN)["chosen"] == "kernel", trial


def test_within_the_margin_the_simpler_backend_serves_and_past_it_the_faster() -> None:
    steady = lambda k: 1.0  # noqa: E731
    assert pick_within_margin(timed_rounds({"gather": 1.0, "kernel": 0.95, "flex": 0.93}, steady), PREFERENCE, MARGIN)["chosen"] == "gather"
    assert pick_within_margin(timed_rounds({"gather": 1.0, "kernel": 0.5, "flex": 0.48}, steady), PREFERENCE, MARGIN)["chosen"] == "kernel"
    assert pick_within_margin(timed_rounds({"gather": 1.0, "kernel": 0.5, "flex": 0.4}, steady), PREFERENCE, MARGIN)["chosen"] == "flex"


def test_each_round_starts_with_the_next_candidate() -> None:
    assert [round_order(["a", "b", "c"], i) for i in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SFS_CACHE_DIR", str(tmp_path))
    return tmp_path


class CountingProbe:
    """Stands in for the probe: fixed rounds per candidate, and how many times it ran."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, model, store, candidates, rows, **_) -> dict[str, list[float]]:
        self.calls += 1
        return {name: [{"gather": 1.0}.get(name, 0.4)] * 3 for name in candidates}


def test_a_second_start_reuses_the_cached_choice_and_says_where_it_came_from(cache, monkeypatch, caplog) -> None:
    probe = CountingProbe()
    monkeypatch.setattr(attention_choice, "measure_decode_steps", probe)
    _, runner = fake_setup(max_num_seqs=4, budget=16, blocks=64)
    caplog.set_level(logging.INFO)
    first = attention_choice._by_the_rule(runner.store, runner.model, 4)
    assert probe.calls == 1 and "by the rule over" in caplog.text
    [stored] = cache.glob("attention-choice-*.json")
    caplog.clear()
    second = attention_choice._by_the_rule(runner.store, runner.model, 4)
    assert probe.calls == 1 and second.name == first.name
    assert f"using cached choice from {stored} (measured " in caplog.text
    assert not list(cache.glob("*.tmp"))  # written to a temporary name, then renamed


def test_a_changed_key_or_remeasure_measures_again(cache, monkeypatch) -> None:
    probe = CountingProbe()
    monkeypatch.setattr(attention_choice, "measure_decode_steps", probe)
    _, runner = fake_setup(max_num_seqs=4, budget=16, blocks=64)
    attention_choice._by_the_rule(runner.store, runner.model, 4)
    attention_choice._by_the_rule(runner.store, runner.model, 8)  # another row count
    assert probe.calls == 2
    monkeypatch.setattr(attention_choice, "machine_key", lambda: {**startup_cache.machine_key(), "torch_threads": 99})
    attention_choice._by_the_rule(runner.store, runner.model, 4)  # another thread count
    assert probe.calls == 3
    attention_choice._by_the_rule(runner.store, runner.model, 4, remeasure=True)
    assert probe.calls == 4
    _, other_pool = fake_setup(max_num_seqs=4, budget=16, blocks=32)
    attention_choice._by_the_rule(other_pool.store, other_pool.model, 4)  # another pool
    assert probe.calls == 5


@pytest.mark.parametrize("text", ["{not json", '{"key": {}, "measured_at": "x", "result": {"chosen": "gather"}}', "[]", ""])
def test_a_corrupt_cache_file_is_measured_over_with_a_warning_not_a_crash(cache, caplog, text) -> None:
    calls = []
    key = {"machine": "this one"}
    first = measured_once("rule", key, lambda: calls.append(1) or {"chosen": "a"})
    first.path.write_text(text)
    again = measured_once("rule", key, lambda: calls.append(1) or {"chosen": "b"})
    assert len(calls) == 2 and again.result == {"chosen": "b"} and not again.from_cache
    assert any(r.levelno == logging.WARNING and str(first.path) in r.getMessage() for r in caplog.records)
    assert json.loads(first.path.read_text())["result"] == {"chosen": "b"}  # and replaced by a good one
    assert measured_once("rule", key, lambda: calls.append(1) or {"chosen": "c"}).from_cache and len(calls) == 2


def test_choose_once_records_how_long_the_measurement_took(cache) -> None:
    assert choose_once("rule", {"k": 1}, lambda: {"chosen": "a", "median_ms": {"a": 1.0}}) == "a"
    [path] = cache.glob("rule-choice-*.json")
    stored = json.loads(path.read_text())
    assert stored["key"] == {"k": 1} and stored["result"]["seconds"] >= 0 and stored["measured_at"]


def test_the_probe_says_what_it_measures_and_about_how_long_before_it_does(caplog) -> None:
    _, runner = fake_setup(max_num_seqs=4, budget=16, blocks=64)
    backends = {"gather": attention_choice.GatherAttention(runner.store)}
    caplog.set_level(logging.INFO)
    attention_choice.measure_decode_steps(runner.model, runner.store, backends, sequences=2, rounds=3)
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("measuring decode attention")]
    assert line.startswith("measuring decode attention: gather, 3 rounds of one 2-row step each, about ") and line.endswith(" s")
    caplog.clear()
    attention_choice.measure_decode_steps(runner.model, runner.store, backends, sequences=2, rounds=0)  # a warm-up says nothing
    assert not caplog.records


def test_compilers_cache_under_the_cache_dir_unless_the_user_chose_a_place(cache, monkeypatch) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    use_cache_for_compilers()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")
    use_cache_for_compilers()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/else"


def test_the_kernel_is_built_into_the_cache_dir(cache) -> None:
    from chapters.ch08_continuous_batching.fast.attention_kernel import KernelUnavailable, build_kernel

    try:
        build_kernel()
    except KernelUnavailable as error:
        pytest.skip(str(error))
    assert [p.suffix for p in cache.iterdir()] == [".so"]


def test_only_the_optional_libraries_warnings_nobody_can_act_on_are_dropped(caplog) -> None:
    quiet_unactionable_warnings()
    quiet_unactionable_warnings()  # twice: one filter each
    assert len(logging.getLogger("torchao").filters) == 1
    so = "/venv/site-packages/torchao"
    logging.getLogger("torchao").warning(f"Failed to load {so}/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load")
    logging.getLogger("torchao").warning(f"Failed to load {so}/_C_cutlass_90a.abi3.so: Could not load")
    logging.getLogger("torch.utils._pytree").warning(
        "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type.", "<enum 'X'>")
    logging.getLogger("torchao").warning(f"Failed to load {so}/_C.abi3.so: undefined symbol")  # its CPU kernels: kept
    logging.getLogger("torchao").warning("something else")  # kept
    kept = [r.getMessage() for r in caplog.records]
    assert kept == [f"Failed to load {so}/_C.abi3.so: undefined symbol", "something else"]


@pytest.mark.parametrize("field, change", [
    ("cpu_flags", lambda m: m.setattr(startup_cache, "cpu_flags", lambda every=False: ["avx2", "fma"])),
    ("aten_capability", lambda m: m.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")),
    ("torch", lambda m: m.setattr(torch, "__version__", "0.0.0")),
    ("torch_threads", lambda m: m.setattr(torch, "get_num_threads", lambda: 97)),
])
def test_the_machine_key_changes_with_each_field_a_choice_depends_on(monkeypatch, field, change) -> None:
    before = startup_cache.machine_key()
    change(monkeypatch)
    after = startup_cache.machine_key()
    assert before[field] != after[field] and {k for k in before if before[k] != after[k]} == {field}


def test_the_attention_choice_is_keyed_by_the_caches_dtype(cache, monkeypatch) -> None:
    keys = []
    monkeypatch.setattr(attention_choice, "choose_once", lambda what, key, measure, remeasure=False: keys.append(key) or "gather")
    for dtype in (torch.float32, torch.bfloat16):
        _, runner = fake_setup(max_num_seqs=4, budget=16, blocks=64, dtype=dtype)
        attention_choice._by_the_rule(runner.store, runner.model, 4)
    assert [key["kv"] for key in keys] == ["torch.float32", "torch.bfloat16"]


@pytest.mark.parametrize("change", ["source", "cpu flags", "compiler"])
def test_the_kernels_build_is_named_for_its_source_flags_compiler_and_cpu(cache, monkeypatch, change) -> None:
    from chapters.ch05_inference_engine import native_library
    from chapters.ch08_continuous_batching.fast import attention_kernel

    before = attention_kernel.kernel_target("cc", cache)
    if change == "source":
        edited = cache / "paged_decode.c"
        edited.write_text(attention_kernel.KERNEL_SOURCE.read_text() + "\n")
        monkeypatch.setattr(attention_kernel, "KERNEL_SOURCE", edited)
    elif change == "cpu flags":
        monkeypatch.setattr(native_library, "cpu_flags", lambda every=False: ["sse2"])
    after = attention_kernel.kernel_target("gcc" if change == "compiler" else "cc", cache)
    assert after != before and after.parent == before.parent == cache
