"""Prompt hygiene: find content that breaks the prefix cache, say where and what it costs."""
