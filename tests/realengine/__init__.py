"""Real-engine tests: llama.cpp's server (from the `xllamacpp` wheel) with a tiny seeded
random-weight model generated here, fronted by `gateway serve`.

`model` writes the GGUF, `engine` starts llama.cpp replicas as separate processes,
`workload` builds deterministic multi-session chat traffic and measures it.
"""
