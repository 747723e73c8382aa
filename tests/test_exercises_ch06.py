"""Graded tests of chapter 6's exercises: the adaptive window rule (ch06.1), the arrival rate (ch06.2), the tuned
file's knobs under flags and environment variables (ch06.3)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from batcher_fakes import FakeClock, FakeModel, run

from chapters.ch03_dynamic_batching.batcher import BatcherConfig
from chapters.ch06_tuned_batching.adaptive_window import AdaptiveBatcher, ArrivalRate
from chapters.ch06_tuned_batching.server import (
    TUNED_FIELDS,
    TunedSettings,
    apply_tuned_config,
)
from shared.settings import parse_settings

# ----------------------------------------------------------------------------- ch06.2: arrival rate


@pytest.mark.exercise("ch06.2")
def test_nothing_is_expected_before_two_arrivals_were_seen() -> None:
    rate = ArrivalRate(smoothing=0.5)
    assert rate.expected_within(1.0, now=0.0) == 0.0
    rate.observe(0.0)
    assert rate.expected_within(1.0, now=0.0) == 0.0
    assert rate.mean_gap_s is None and rate.last_gap_s is None and rate.last_arrival == 0.0


@pytest.mark.exercise("ch06.2")
def test_the_mean_gap_is_smoothed_and_the_latest_gap_is_kept() -> None:
    rate = ArrivalRate(smoothing=0.5)
    for now in (0.0, 1.0, 1.25):
        rate.observe(now)
    # gaps 1.0 then 0.25; mean: 1.0, then 1.0 + 0.5 * (0.25 - 1.0) = 0.625
    assert rate.mean_gap_s == pytest.approx(0.625)
    assert rate.last_gap_s == pytest.approx(0.25)
    assert rate.last_arrival == 1.25


@pytest.mark.exercise("ch06.2")
def test_expected_arrivals_use_the_shorter_gap_but_never_less_than_the_silence() -> None:
    rate = ArrivalRate(smoothing=0.5)
    for now in (0.0, 1.0, 1.25):  # mean gap 0.625, latest 0.25
        rate.observe(now)
    assert rate.expected_within(0.5, now=1.25) == pytest.approx(0.5 / 0.25), "a burst shows in the latest gap"
    assert rate.expected_within(0.5, now=1.5) == pytest.approx(0.5 / 0.25)  # silent for 0.25 s: no longer than the gap
    assert rate.expected_within(0.5, now=3.25) == pytest.approx(0.5 / 2.0), "2 s of silence: at most one arrival per 2 s"


@pytest.mark.exercise("ch06.2")
def test_simultaneous_arrivals_expect_many_more_not_a_division_by_zero() -> None:
    rate = ArrivalRate()
    rate.observe(5.0)
    rate.observe(5.0)
    assert rate.expected_within(0.001, now=5.0) >= 1.0


# ----------------------------------------------------------------------------- ch06.1: the rule


class FixedRate:
    """Stands in for ArrivalRate: says how many arrivals it expects, records what it was asked."""

    def __init__(self, expected: float) -> None:
        self.expected = expected
        self.asked: list[tuple[float, float]] = []

    def observe(self, now: float) -> None:
        pass

    def expected_within(self, window_s: float, now: float) -> float:
        self.asked.append((window_s, now))
        return self.expected


def adaptive(clock: FakeClock, expected: float | None = None) -> AdaptiveBatcher:
    batcher = AdaptiveBatcher(lambda requests: requests, BatcherConfig(max_batch=32, min_batch=8, window_s=0.5),
                              clock=clock, min_window_s=0.125)
    if expected is not None:
        batcher.arrivals = FixedRate(expected)
    return batcher


@pytest.mark.exercise("ch06.1")
@pytest.mark.parametrize(("expected", "window"), [(0.0, 0.125), (0.99, 0.125), (1.0, 0.5), (7.0, 0.5)])
def test_the_full_window_only_when_at_least_one_more_arrival_is_expected(expected: float, window: float) -> None:
    clock = FakeClock()
    clock.time = 3.0
    batcher = adaptive(clock, expected)
    assert batcher.window_s() == window
    assert batcher.arrivals.asked == [(0.5, 3.0)], "ask about the configured window, at the clock's now"


@pytest.mark.exercise("ch06.1")
def test_a_quiet_server_sends_a_lone_request_after_the_short_window() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        model = FakeModel(asyncio.get_running_loop())
        batcher = AdaptiveBatcher(model, BatcherConfig(max_batch=32, min_batch=8, window_s=0.5), clock=clock, min_window_s=0.125)
        batcher.start()
        only = batcher.enqueue("x")
        parked = asyncio.ensure_future(clock.until_parked())
        done, _ = await asyncio.wait({parked, batcher._collector}, return_when=asyncio.FIRST_COMPLETED)
        if parked not in done:
            parked.cancel()
            batcher._collector.result()  # a stub's error, raised in the collector
        assert clock.deadline == 0.125
        await clock.advance(0.125)
        assert await only == "out:x"
        await batcher.close()

    run(scenario)


# ----------------------------------------------------------------------------- ch06.3: the tuned file


CHOSEN = {"max_batch": 12, "min_batch": 3, "window_ms": 2.5}  # none of them a default of TunedSettings


@pytest.fixture
def tuned_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in TUNED_FIELDS + ("fallback_slots", "tuned_config"):
        monkeypatch.delenv(f"SFS_{name.upper()}", raising=False)  # the grader's own environment must not count
    path = tmp_path / "tuned.json"
    # Other keys of "chosen" are not knobs the file may set.
    path.write_text(json.dumps({"chosen": {**CHOSEN, "fallback_slots": 9}, "objective": "graded"}), encoding="utf-8")
    return path


def knobs(settings: TunedSettings) -> dict:
    return {name: getattr(settings, name) for name in TUNED_FIELDS}


@pytest.mark.exercise("ch06.3")
def test_the_knobs_come_from_the_tuned_file_and_nothing_else_does(tuned_file: Path) -> None:
    given = TunedSettings(tuned_config=str(tuned_file))
    applied = apply_tuned_config(given)
    assert knobs(applied) == CHOSEN
    assert applied.fallback_slots == TunedSettings().fallback_slots, "only the tuned knobs come from the file"
    assert knobs(given) == knobs(TunedSettings()), "a new settings object: the one given is not changed"


@pytest.mark.exercise("ch06.3")
def test_a_flag_wins_over_the_tuned_file(tuned_file: Path) -> None:
    settings = parse_settings(TunedSettings, ["--tuned-config", str(tuned_file), "--window-ms", "7"])
    assert knobs(apply_tuned_config(settings)) == {**CHOSEN, "window_ms": 7.0}


@pytest.mark.exercise("ch06.3")
def test_a_flag_equal_to_the_default_still_wins(tuned_file: Path) -> None:
    default_batch = TunedSettings().max_batch
    settings = parse_settings(TunedSettings, ["--tuned-config", str(tuned_file), "--max-batch", str(default_batch)])
    assert knobs(apply_tuned_config(settings)) == {**CHOSEN, "max_batch": default_batch}, "set is set, whatever the value"


@pytest.mark.exercise("ch06.3")
def test_an_environment_variable_wins_over_the_tuned_file(tuned_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SFS_MIN_BATCH", "5")
    settings = parse_settings(TunedSettings, ["--tuned-config", str(tuned_file)])
    assert knobs(apply_tuned_config(settings)) == {**CHOSEN, "min_batch": 5}


@pytest.mark.exercise("ch06.3")
def test_none_or_a_missing_file_leaves_the_settings_as_they_are(tuned_file: Path) -> None:
    for source in ("none", str(tuned_file.with_name("absent.json"))):
        settings = TunedSettings(tuned_config=source, window_ms=4.0)
        assert knobs(apply_tuned_config(settings)) == knobs(settings)
