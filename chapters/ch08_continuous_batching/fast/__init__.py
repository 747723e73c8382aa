"""The fast path beside chapter 8's core: attention backends that read the pool in place, the rule that picks one, CUDA graphs."""
