"""The leak check flags the article's leak (a failed request's intermediate kept alive) and passes its fix."""

from __future__ import annotations

import asyncio

import pytest

from chapters.ch07_production.leakcheck import run_leakcheck


@pytest.mark.slow
def test_the_planted_leak_is_flagged_and_the_finally_fix_is_not() -> None:
    # Few requests: each leaked intermediate is a context-sized tensor, far above the threshold per 1,000.
    leaky = asyncio.run(run_leakcheck("leaky", requests=60, warmup=30, fail_share=0.2, concurrency=16))
    fixed = asyncio.run(run_leakcheck("fixed", requests=60, warmup=30, fail_share=0.2, concurrency=16))
    assert leaky.failed > 0 and fixed.failed > 0
    assert leaky.leaking, leaky
    assert not fixed.leaking, fixed
