"""The autotuner on the smoke profile: real servers, real load, a valid configuration written."""

from __future__ import annotations

import json

import pytest

from benchmarks.autotune import Candidate, Trial, choose, main
from chapters.ch06_tuned_batching.server import TUNED_FIELDS, TunedSettings, apply_tuned_config


def trial(qps: float, p99_ms: float, errors: int = 0, max_batch: int = 32) -> Trial:
    return Trial(Candidate(max_batch, 8, 5.0), 64, qps, p99_ms / 2, p99_ms, errors, "f.json")


def test_choose_takes_the_fastest_under_the_slo() -> None:
    fast_but_slow_tail, best, slower = trial(120, 2500), trial(100, 900, max_batch=64), trial(80, 500)
    broken = trial(150, 100, errors=3)
    assert choose([fast_but_slow_tail, best, slower, broken], slo_p99_ms=1000) is best
    assert choose([fast_but_slow_tail], slo_p99_ms=1000) is None


@pytest.mark.slow  # make test-slow: two real trials; reading tuned.json is tested on every run
def test_the_tuner_writes_a_configuration_the_server_reads(tmp_path) -> None:
    out = tmp_path / "tuned.json"
    main(["--profile", "smoke", "--max-batch", "4,8", "--min-batch", "2", "--window-ms", "2",
          "--levels", "2", "--slo-p99-ms", "100000", "--server-arg=--engine=eager",
          "--out", str(out), "--results", str(tmp_path / "results")])
    document = json.loads(out.read_text())
    assert len(document["trials"]) == 2
    assert all(t["qps"] > 0 and t["errors"] == 0 for t in document["trials"])
    chosen = document["chosen"]
    assert {"max_batch": chosen["max_batch"], "min_batch": 2, "window_ms": 2.0} == chosen
    assert chosen["max_batch"] in (4, 8)
    assert document["measured"]["qps"] == max(t["qps"] for t in document["trials"])

    settings = apply_tuned_config(TunedSettings(tuned_config=str(out)))
    assert {name: getattr(settings, name) for name in TUNED_FIELDS} == chosen
    flag_wins = apply_tuned_config(TunedSettings(tuned_config=str(out), window_ms=7.0))
    assert flag_wins.window_ms == 7.0 and flag_wins.max_batch == chosen["max_batch"]
