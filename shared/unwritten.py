"""An exercise not written yet must not stop a later chapter from starting.

A student tree (``python -m exercises student``) replaces each exercise's code with ``raise
NotImplementedError("chNN.k: ...")``. Where a server's start-up path runs an exercise's code (the
pool's sizing rule, the engine's rule, the tuned file), the server calls it through
:func:`or_meanwhile`, which, for a stub only, logs what is missing and uses a plain stand-in that is
not the exercise's answer (the graded tests call the exercise's code directly and still see the stub).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger("shared.unwritten")

T = TypeVar("T")


def or_meanwhile(compute: Callable[[], T], stand_in: Callable[[], T], meanwhile: str) -> T:
    """``compute()``; if it is an exercise's stub, ``stand_in()``, saying ``meanwhile`` what the server does instead."""
    try:
        return compute()
    except NotImplementedError as stub:
        log.warning("%s; meanwhile %s", stub, meanwhile)
        return stand_in()
