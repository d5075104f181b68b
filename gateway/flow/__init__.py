"""One request flow for every transport (`gateway serve`'s HTTP proxy, `gateway epp`'s
ext_proc picker): the bookkeeping, admission and priorities of an inference request, with
no bytes moved here (gateway.flow.core)."""
