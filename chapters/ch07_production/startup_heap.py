"""Freeze the start-up heap: what exists once the server is built stays out of every later garbage collection.

Python's cycle collector walks the objects of a generation each time it collects it, and the oldest
generation holds everything a server built before its first request: the model's modules and
parameters, FastAPI's routes, pydantic's schemas, every imported module's objects. None of it will
ever be garbage, yet each full collection during serving walks all of it again, on the event loop's
thread or the step thread, whichever allocated last. ``gc.freeze()`` moves every object alive now
into a permanent generation that collections skip; objects made afterwards are collected as before.

Collect first: ``gc.freeze()`` takes objects as it finds them, so garbage still waiting for a
collection would be frozen with the rest and never freed. vLLM does the same once its engine has
started (``freeze_gc_heap`` in ``vllm/utils/gc_utils.py``).
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect every generation, then freeze what is left; returns how many objects are now frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("froze %d objects alive after start-up: later garbage collections skip them", frozen)
    return frozen
