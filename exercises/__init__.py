"""The instructors' side: exercises marked in the chapters' code, student trees, grading.

``python -m exercises student --chapter ch03 --out DIR`` writes a copy of the repository whose
chapter 3 exercises raise ``NotImplementedError``; ``python -m exercises grade --tree DIR`` runs the
graded tests against that copy. ``exercises/README.md`` is the instructors' guide.
"""
