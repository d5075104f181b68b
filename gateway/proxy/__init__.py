"""The request path: the ASGI app, inbound parsing and checks, the proxy handler, the relay,
and the upstream client seam. Routing, hygiene, usage and replicas are separate packages it
sequences (design.md section 2)."""
