"""Studies: one question each, answered by measurement. Every folder holds its script(s), a README
with the question, the command and the answer, and the results it reads them from (see README.md)."""
