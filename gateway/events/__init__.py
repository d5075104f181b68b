"""vLLM KV-cache events: decoding, the token-mode index, and the per-replica subscriber."""
