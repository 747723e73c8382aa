"""Which exercises a *toggle tree* treats as stubbed right now (the meta-test's tree, never a learner's).

A toggle tree (``exercises.tree.write_tree(..., toggle=True)``) keeps every solution and puts in
front of each region ``if is_stubbed("chNN.k"): raise NotImplementedError(...)``. The pytest plugin
sets the graded test's own exercise here for the duration of the test, so one run of one process
shows, for every exercise, what its tests do on a tree where only it is stubbed.
"""

from __future__ import annotations

_stubbed: frozenset[str] = frozenset()


def is_stubbed(exercise_id: str) -> bool:
    return exercise_id in _stubbed


def set_stubbed(exercise_ids: frozenset[str] | set[str]) -> None:
    """Stub exactly ``exercise_ids`` from now on (an empty set: the solution everywhere)."""
    global _stubbed
    _stubbed = frozenset(exercise_ids)
