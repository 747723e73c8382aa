"""The live_page_cost study (its README.md: the question, the command, the answer)."""
