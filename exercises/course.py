"""The course: every graded exercise in the order to do it, its time, and what it needs done first.

The order is the one the chapters teach in. Within a chapter an exercise comes after every exercise
whose code its graded tests run (its ``needs``); an exercise needs nothing from later chapters, and
everything from earlier chapters is assumed done (a ``student --all`` tree is worked through in this
order). The meta-test holds the plan to the code: with an exercise and its ``needs`` solved, and every
other exercise of its chapter and of later chapters stubbed, its graded tests pass.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    id: str
    minutes: int  # a learner's time, as an instructor would plan a session
    needs: tuple[str, ...] = ()  # exercises of the same chapter whose code its graded tests run


COURSE: tuple[Step, ...] = (
    Step("ch01.1", 30),
    Step("ch01.2", 30, needs=("ch01.1",)),
    Step("ch01.3", 10),
    Step("ch02.3", 20),
    Step("ch02.2", 15),
    Step("ch02.1", 15, needs=("ch02.2", "ch02.3")),
    Step("ch03.1", 45),
    Step("ch03.2", 30, needs=("ch03.1",)),
    Step("ch03.3", 20),
    Step("ch04.3", 10),
    Step("ch04.1", 30),
    Step("ch04.2", 45, needs=("ch04.1",)),
    Step("ch04.4", 20),
    Step("ch05.1", 15),
    Step("ch05.2", 15),
    Step("ch05.3", 15),
    Step("ch06.2", 30),
    Step("ch06.1", 15, needs=("ch06.2",)),
    Step("ch06.3", 15),
    Step("ch07.1", 15),
    Step("ch07.2", 30),
    Step("ch07.3", 30),
    Step("ch07.4", 20, needs=("ch07.1",)),
    Step("ch08.1", 30),
    Step("ch08.4", 20),
    Step("ch08.5", 15, needs=("ch08.1",)),
    Step("ch08.2", 45, needs=("ch08.1", "ch08.4", "ch08.5")),
    Step("ch08.3", 30, needs=("ch08.1", "ch08.2", "ch08.4", "ch08.5")),
    Step("ch08.6", 15, needs=("ch08.1",)),
    Step("ch08.7", 20),
    Step("ch09.3", 15),
    Step("ch09.1", 20),
    Step("ch09.2", 30, needs=("ch09.3",)),
    Step("ch09.4", 15),
)

STEPS = {step.id: step for step in COURSE}


def stubbed_around(exercise_ids: set[str] | frozenset[str]) -> frozenset[str]:
    """What the order check stubs while a graded test of ``exercise_ids`` runs: every exercise of
    their chapters and of later chapters except them and what they need."""
    keep = set(exercise_ids).union(*(STEPS[i].needs for i in exercise_ids))
    first = min(i.split(".")[0] for i in exercise_ids)
    return frozenset(s.id for s in COURSE if s.id.split(".")[0] >= first and s.id not in keep)
