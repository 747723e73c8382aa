"""The decode_attention study (its README.md: the question, the command, the answer)."""
