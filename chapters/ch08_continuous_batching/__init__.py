"""Chapter 8: continuous batching over a paged KV cache, token streaming, an OpenAI-compatible API."""
