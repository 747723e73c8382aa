"""The replicas_and_routers study (its README.md: the question, the command, the answer)."""
