"""Flags the cross-chapter tests give a chapter's server."""

from __future__ import annotations

# Chapters whose default precision is chosen by measurement (chapter 5's engine, composed by 6, 7 and 8).
CHAPTERS_WITH_PRECISION = ("ch05", "ch06", "ch07", "ch08")


def oracle_exact_args(chapter: str) -> tuple[str, ...]:
    """Flags that make ``chapter`` promise the oracle's exact tokens.

    From chapter 5 on, the default precision is the fastest within the accuracy tolerance (bf16 on
    most machines), whose tokens may differ; exactness is the promise of ``--precision fp32``.
    """
    return ("--precision", "fp32") if chapter in CHAPTERS_WITH_PRECISION else ()


# Greedy tokens of a reduced precision equal to the oracle's, position by position: the tolerance
# measured by chapter 5's trade-off table (see tests/test_ch05_engines.py, MIN_TOKEN_AGREEMENT).
MIN_TOKEN_AGREEMENT = 0.6


def attention_here(name: str, store):
    """Chapter 8's attention backend ``name`` over ``store``, or the test skipped with the backend's own reason
    when it cannot run on this machine (flex on a CPU where torch finds no vector instructions to compile for:
    ``make test-cpus`` at ``ATEN_CPU_CAPABILITY=default``). CI's machines run every backend."""
    import pytest

    from chapters.ch08_continuous_batching.fast.attention_choice import build_attention

    try:
        return build_attention(name, store)
    except ValueError as unavailable:
        pytest.skip(str(unavailable))
