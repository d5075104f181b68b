"""Prefix-affinity routing: normalize, hash blocks, index replicas, choose by cost."""
