"""The drain_timeline study (its README.md: the question, the command, the answer)."""
