"""A faithful vLLM simulator: a pure engine model plus an OpenAI-compatible HTTP server."""
