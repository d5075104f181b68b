"""Usage accounting: per-request records, sinks, Prometheus metrics and windowed stats."""
