"""Talking to replicas, as both the request path (`gateway.proxy`) and the fleet monitor
(`gateway.replicas`) see it: the `Upstream` seam (seam.py), the errors it raises and the
OpenAI-shaped errors the gateway answers (errors.py), and the pure table of what each failure
allows (failure.py). Neither `proxy` nor `replicas` owns it, so neither imports the other's
types to talk about a replica."""
