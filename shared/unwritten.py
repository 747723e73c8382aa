"""An exercise not written yet must not stop a later chapter from starting.

A student tree (``python -m exercises student``) replaces each exercise's code with ``raise
NotImplementedError("chNN.k: ...")``. Where a server's start-up path runs an exercise's code (the
pool's sizing rule, the engine's rule, the tuned file), the server calls it through
:func:`or_meanwhile`, which, for a stub only, logs what is missing and uses a plain stand-in that is
not the exercise's answer (the graded tests call the exercise's code directly and still see the stub).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger("shared.unwritten")

T = TypeVar("T")

# What a student tree's stub says first (exercises/markers.py writes it): "ch04.3: <title>, see ...".
STUB_MESSAGE = re.compile(r"^ch\d{2}\.\d+: ")


def or_meanwhile(compute: Callable[[], T], stand_in: Callable[[], T], meanwhile: str) -> T:
    """``compute()``; if it is an exercise's stub, ``stand_in()``, saying ``meanwhile`` what the server does instead.

    Any other ``NotImplementedError`` (a library's missing kernel, say) propagates unchanged.
    """
    try:
        return compute()
    except NotImplementedError as stub:
        if not STUB_MESSAGE.match(str(stub)):
            raise
        log.warning("%s; meanwhile %s", stub, meanwhile)
        return stand_in()
