"""The ch08_step_profile study (its README.md: the question, the command, the answer)."""
