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
