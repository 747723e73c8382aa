"""The source article's climb (its GPU, its model): the figures every measured climb is shown beside.

:data:`ARTICLE` holds, for chapters 1 to 6, the QPS, the P99 (seconds) and the GPU utilisation (%) the
article reported. Its machine is not ours: compare ratios to :data:`BASELINE`, not absolute numbers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArticleFigure:
    qps: float
    p99_s: float
    gpu_util_percent: float


ARTICLE: dict[str, ArticleFigure] = {
    "ch01": ArticleFigure(12, 3.5, 25),
    "ch02": ArticleFigure(28, 1.8, 35),
    "ch03": ArticleFigure(95, 0.6, 72),
    "ch04": ArticleFigure(120, 0.45, 78),
    "ch05": ArticleFigure(185, 0.28, 85),
    "ch06": ArticleFigure(210, 0.25, 88),
}
ARTICLE_CHAPTERS: tuple[str, ...] = tuple(ARTICLE)
BASELINE = "ch01"
