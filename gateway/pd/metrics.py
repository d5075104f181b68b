"""P/D's Prometheus families, registered on the gateway's own registry
(`GatewayMetrics.registry`, gateway.usage.metrics), beside `/stats`' `pd` counts
(gateway.pd.stats, which feeds them).

- `gateway_pd_legs_total{leg,outcome}` counter: `leg` prefill or decode; `outcome` "ok"
  (P's params read; D's answer relayed) or a failure class of gateway.upstream.failure,
  or "no_params" (P answered nothing to pull)
- `gateway_pd_requests_total{served}` counter: how a P/D request was served: `two_legs`,
  D alone because its cache covered the prompt (`cached`), no prefill replica could take
  it (`no_prefill`), every prefill leg failed (`prefill_failed`), every prefill replica
  was at `[admission] replica_max_in_flight` (`prefill_full`), or P answered it whole
  after the decode leg failed (`prefill_alone`)
- `gateway_pd_transfers_total` counter: prefill legs whose KV was offered to a decoder
- `gateway_pd_transferred_tokens_total` counter: the tokens offered (vLLM's
  `remote_num_tokens`)
- `gateway_pd_decoder_kv_total{result}` counter (`[pd] reuse_decoder_kv`): `kept` (a
  decoder's params kept for the next turn), `hit` (sent with a prefill leg: P pulls the
  turn back from D), `miss` (a two-leg request prefilled afresh)

Every label value is a fixed set in the code: the families are bounded whatever clients
send. They are tenant-scoped (gateway.usage.exposure does not list them: which requests a
decoder's cache covered, or reused, moves with other tenants' conversations), so only the
operator reads them.
"""

from __future__ import annotations

from typing import get_args

from prometheus_client import CollectorRegistry, Counter

from gateway.upstream.failure import Happened

OUTCOMES = ("ok", "no_params", *get_args(Happened))
SERVED = ("two_legs", "cached", "no_prefill", "prefill_failed", "prefill_full",
          "prefill_alone")
REUSE = ("kept", "hit", "miss")


class PdMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._legs = Counter("gateway_pd_legs", "P/D legs by leg and outcome.",
                             ("leg", "outcome"), registry=registry)
        self._served = Counter("gateway_pd_requests", "P/D requests by how they were served.",
                               ("served",), registry=registry)
        self._transfers = Counter("gateway_pd_transfers",
                                  "Prefill legs whose KV was offered to a decode replica.",
                                  registry=registry)
        self._tokens = Counter("gateway_pd_transferred_tokens",
                               "Prompt tokens whose KV a prefill replica offered.",
                               registry=registry)
        self._reuse = Counter("gateway_pd_decoder_kv",
                              "A decoder's returned KV params kept, sent (hit), or not sent "
                              "with a two-leg request (miss).", ("result",), registry=registry)
        self._pulled = Counter("gateway_pd_pulled_tokens",
                               "Tokens prefill replicas pulled back from decoders.",
                               registry=registry)
        # every series present from the start (fixed sets): a rate() needs no first sample
        for leg in ("prefill", "decode"):
            for outcome in OUTCOMES:
                self._legs.labels(leg, outcome)
        for served in SERVED:
            self._served.labels(served)
        for result in REUSE:
            self._reuse.labels(result)

    def leg(self, leg: str, outcome: str) -> None:
        self._legs.labels(leg, outcome).inc()

    def served(self, how: str) -> None:
        self._served.labels(how).inc()

    def transferred(self, tokens: int | None) -> None:
        self._transfers.inc()
        self._tokens.inc(tokens or 0)

    def pulled(self, tokens: int) -> None:
        self._pulled.inc(tokens)

    def reuse(self, result: str) -> None:
        self._reuse.labels(result).inc()
