"""The kv_share study (its README.md: the question, the command, the answer)."""
