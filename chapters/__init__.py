"""The chapters, in the order a learner runs them.

Adding a chapter to :data:`CHAPTERS` adds it to the contract and equivalence tests, the harness and
the climb: each entry is started as ``python -m chapters.<folder> --port N``.
"""

CHAPTERS: dict[str, str] = {
    "ch01": "ch01_flask_sync",
    "ch02": "ch02_fastapi_async",
    "ch03": "ch03_dynamic_batching",
    "ch04": "ch04_memory_pool",
    "ch05": "ch05_inference_engine",
    "ch06": "ch06_tuned_batching",
    "ch07": "ch07_production",
    "ch08": "ch08_continuous_batching",
}


def module_for(chapter: str) -> str:
    """``ch02`` -> ``chapters.ch02_fastapi_async`` (also accepts the folder name)."""
    folder = CHAPTERS.get(chapter, chapter)
    if folder not in CHAPTERS.values():
        raise KeyError(f"unknown chapter {chapter!r}; known: {', '.join(CHAPTERS)}")
    return f"chapters.{folder}"
