"""The ttft_split study (its README.md: the question, the command, the answer)."""
