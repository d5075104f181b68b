"""Caching-aware OpenAI-compatible gateway for vLLM fleets."""

__version__ = "0.1.0"
