"""Prefill/decode disaggregation."""
