"""Flags the cross-chapter tests give a chapter's server."""

from __future__ import annotations

FIRST_CHAPTER_WITH_PRECISION = "ch05"


def oracle_exact_args(chapter: str) -> tuple[str, ...]:
    """Flags that make ``chapter`` promise the oracle's exact tokens.

    From chapter 5 on, the default precision is the fastest within the accuracy tolerance (bf16 on
    most machines), whose tokens may differ; exactness is the promise of ``--precision fp32``.
    """
    return ("--precision", "fp32") if chapter >= FIRST_CHAPTER_WITH_PRECISION else ()
