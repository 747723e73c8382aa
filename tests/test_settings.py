"""One meaning per knob: every chapter's settings, composed from option groups, read from flags.

The oracle here is the rule the project states (``shared/settings.py``): a knob that appears in two
chapters is the same knob (same constraints, description and default; chapter 6's tuned batcher
knobs change their defaults, which is chapter 6's lesson, and chapter 8's pool its block size, measured
for its paged decode: their only exceptions), no two knobs differ only by their
unit, no chapter's settings are another chapter's settings plus more, and a refused value is a
one-line error with exit status 2, never a traceback.
"""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Literal

import pytest

from chapters.ch01_flask_sync.server import FlaskSyncSettings
from chapters.ch03_dynamic_batching.server import BatchingSettings
from chapters.ch04_memory_pool.server import PoolSettings
from chapters.ch05_inference_engine.server import EngineSettings
from chapters.ch06_tuned_batching.server import TUNED_FIELDS, TunedSettings
from chapters.ch07_production.server import ProductionSettings
from chapters.ch08_continuous_batching.server import ContinuousSettings
from chapters.ch09_scale_out.server import ScaleOutSettings
from shared.settings import ServerSettings, parse_settings

CHAPTER_SETTINGS = {
    "ch01": FlaskSyncSettings, "ch02": ServerSettings, "ch03": BatchingSettings, "ch04": PoolSettings,
    "ch05": EngineSettings, "ch06": TunedSettings, "ch07": ProductionSettings, "ch08": ContinuousSettings,
    "ch09": ScaleOutSettings,
}
TUNED_FROM = {"ch06", "ch07"}  # the chapters whose batcher defaults are chapter 6's tuned ones
PAGED_FROM = {"ch08", "ch09"}  # the chapters whose pool is chapter 8's paged one, with its measured block size
PAGED_FIELDS = ("block_tokens",)  # the pool knobs whose default chapter 8 sets (its words stay chapter 4's)


def field_meanings(name: str) -> dict[tuple, list[str]]:
    """For one knob: which chapters give it which (constraints, description, default)."""
    meanings: dict[tuple, list[str]] = {}
    for chapter, settings in CHAPTER_SETTINGS.items():
        field = settings.model_fields.get(name)
        if field is None:
            continue
        tuned = name in TUNED_FIELDS  # their defaults and words are chapter 6's: the next test
        paged = name in PAGED_FIELDS  # its default is chapter 8's (the test after), its words chapter 4's
        key = (repr(field.metadata), repr(field.annotation),
               None if tuned else field.description, None if tuned or paged else repr(field.default))
        meanings.setdefault(key, []).append(chapter)
    return meanings


ALL_KNOBS = sorted({name for settings in CHAPTER_SETTINGS.values() for name in settings.model_fields})


@pytest.mark.parametrize("name", ALL_KNOBS)
def test_a_knob_means_the_same_in_every_chapter_that_has_it(name: str) -> None:
    meanings = field_meanings(name)
    assert len(meanings) == 1, f"--{name.replace('_', '-')} means different things: {meanings}"


def test_the_tuned_batcher_knobs_change_only_their_defaults_and_only_from_chapter_6() -> None:
    for name in TUNED_FIELDS:
        before = {repr(CHAPTER_SETTINGS[c].model_fields[name].default) for c in ("ch03", "ch04", "ch05")}
        after = {repr(CHAPTER_SETTINGS[c].model_fields[name].default) for c in TUNED_FROM}
        assert len(before) == len(after) == 1 and before != after, name


def test_the_paged_pools_block_size_changes_only_its_default_and_only_from_chapter_8() -> None:
    for name in PAGED_FIELDS:
        before = {repr(CHAPTER_SETTINGS[c].model_fields[name].default) for c in ("ch04", "ch05", "ch06", "ch07")}
        after = {repr(CHAPTER_SETTINGS[c].model_fields[name].default) for c in PAGED_FROM}
        assert len(before) == len(after) == 1 and before != after, name


def test_no_two_knobs_differ_only_by_their_unit() -> None:
    units = re.compile(r"_(ms|s|bytes|tokens|mib|gib)$")
    by_stem: dict[str, set[str]] = {}
    for name in ALL_KNOBS:
        by_stem.setdefault(units.sub("", name), set()).add(name)
    assert [names for names in by_stem.values() if len(names) > 1] == []


def test_settings_are_composed_from_option_groups_not_one_chapter_on_another() -> None:
    for chapter, settings in CHAPTER_SETTINGS.items():
        others = [c for c, s in CHAPTER_SETTINGS.items() if s not in (settings, ServerSettings) and issubclass(settings, s)]
        assert others == [], f"{chapter}'s settings extend {others}'s: compose the option groups instead"


@pytest.mark.parametrize(
    ("settings", "argv", "message"),
    [
        (ContinuousSettings, ["--max-num-batched-tokens", "8"], "max_num_batched_tokens (8) must be >= max_num_seqs (64)"),
        (ContinuousSettings, ["--max-num-seqs", "abc"], "--max-num-seqs: Input should be a valid integer"),
        (BatchingSettings, ["--min-batch", "9", "--max-batch", "8"], "min_batch (9) must not exceed max_batch (8)"),
        (ServerSettings, ["--port", "70000"], "--port: Input should be less than or equal to 65535"),
    ],
)
def test_a_refused_value_is_one_clear_line_and_exit_status_2(settings, argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_settings(settings, argv, prog="server")
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("server: error: ") and message in err and err.count("\n") == 1, err


def test_a_chapter_started_with_a_refused_value_prints_no_traceback() -> None:
    done = subprocess.run([sys.executable, "-m", "chapters.ch08_continuous_batching", "--max-num-batched-tokens", "8"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "must be >= max_num_seqs" in done.stderr


@pytest.mark.parametrize("chapter", ["ch04_memory_pool", "ch07_production", "ch08_continuous_batching"])
def test_a_pool_too_small_for_the_models_context_is_one_line_and_exit_2(chapter: str) -> None:
    """Refused only once the model is loaded (its context), yet refused as a flag is: no traceback."""
    precision = () if chapter.startswith("ch04") else ("--precision", "fp32")
    done = subprocess.run([sys.executable, "-m", f"chapters.{chapter}", "--pool-tokens", "10", *precision],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if ": error: " in line]
    assert errors == [f"python -m chapters.{chapter}: error: a pool of 10 token slots cannot hold one request of "
                      f"512 positions (--pool-tokens 10)"], done.stderr


def out_of_bounds(field) -> str | None:
    """A value just past one of ``field``'s bounds, as a flag's text (None: the field has no bound)."""
    step = 1 if field.annotation in (int, "int") else 0.5
    for bound in field.metadata:
        for attr, past in (("ge", -step), ("gt", 0), ("le", step), ("lt", 0)):
            limit = getattr(bound, attr, None)
            if limit is not None:
                return str(limit + past)
    return None


BOUNDED = [(chapter, name) for chapter, settings in CHAPTER_SETTINGS.items() for name, field in settings.model_fields.items()
           if out_of_bounds(field) is not None or getattr(field.annotation, "__origin__", None) is Literal]


@pytest.mark.parametrize(("chapter", "name"), BOUNDED, ids=[f"{c}-{n}" for c, n in BOUNDED])
def test_every_flags_bad_value_names_the_flag_and_exits_2(chapter: str, name: str, capsys) -> None:
    settings = CHAPTER_SETTINGS[chapter]
    field = settings.model_fields[name]
    value = out_of_bounds(field) or "not-a-choice"
    flag = f"--{name.replace('_', '-')}"
    with pytest.raises(SystemExit) as exited:
        parse_settings(settings, [flag, value], prog="server")
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"server: error: {flag}: Input should be"), err
