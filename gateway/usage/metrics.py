"""The gateway's own Prometheus metrics, in a registry owned by one `GatewayMetrics`.

Every name starts with `gateway_` (never `vllm:`: a dashboard must not mix the engine's
series with ours). Documented metrics, as exposed (counters carry `_total`); the tests
render the registry and check that each of these is present:

Per request (from `UsageRecord`s, `observe`):
- `gateway_requests_total{model,replica,tenant,route,status}` counter
- `gateway_prompt_tokens_total{model,replica,tenant,route}` counter
- `gateway_cached_tokens_total{model,replica,tenant,route}` counter (only engine-reported;
  a P/D request's are its prefill replica's own hits, less any pulled from a decoder)
- `gateway_predicted_cached_tokens_total{model,replica,tenant,route}` counter
- `gateway_best_available_tokens_total{model,replica,tenant,route}` counter
- `gateway_completion_tokens_total{model,replica,tenant,route}` counter
- `gateway_records_without_cached_tokens_total{replica}` counter: the engine reported
  `prompt_tokens` but no `cached_tokens` (vLLM without `--enable-prompt-tokens-details`)
- `gateway_ttft_seconds{model,replica}` histogram: streamed requests only (their first
  byte is the first token; a non-streamed answer's first byte is its last)
- `gateway_non_streamed_latency_seconds{model,replica}` histogram: a non-streamed
  request's whole latency (what a client waits for its answer), apart from the TTFT so
  that a long generation does not read as a slow first token
- `gateway_request_latency_seconds{model,replica}` histogram (every request)
- `gateway_request_prompt_tokens{model,replica}` histogram (prompt length per request,
  buckets up to 128k; not `gateway_prompt_tokens`, which is the counter's family name)
- `gateway_cached_ratio{model,replica}` histogram (cached/prompt per request, 0..1; P/D:
  tokens pulled back from a decoder leave both, `UsageRecord.cache_split`)
- `gateway_endpoint_requests_total{endpoint,status}`,
  `gateway_endpoint_prompt_tokens_total{endpoint}`,
  `gateway_endpoint_cached_tokens_total{endpoint}` counters: the same by inference API
  (`chat`, `completions`, `responses`, `messages`; any forwarded path is `other`)
Request path:
- `gateway_routing_decisions_total{reason}` counter
- `gateway_route_moves_total{reason}` counter (sessions and implicit conversations moved
  off their replica: unavailable, evicted, load)
- `gateway_hygiene_findings_total{kind,severity}` counter
- `gateway_usage_sink_errors_total{sink}` counter (failed sink writes)
- `gateway_usage_records_dropped_total{sink}` counter (records a sink lost: queue full or
  failed write)
Replicas (`replica_state`, after each health probe / scrape):
- `gateway_replica_healthy{replica}` gauge (1/0)
- `gateway_replica_in_flight{replica}` gauge (this gateway's requests in flight there)
- `gateway_replica_kv_cache_usage{replica}` gauge 0..1, last scrape
- `gateway_replica_requests_waiting{replica}`, `gateway_replica_requests_running{replica}`
  gauges, last scrape
- `gateway_replica_prefix_cache_hits_tokens{replica}`,
  `gateway_replica_prefix_cache_queries_tokens{replica}` gauges: the engine's own
  cumulative counters copied at the last scrape. They are gauges because the gateway does
  not own them (they reset when the engine restarts); take `delta()` over them, or read the
  engine's `vllm:prefix_cache_*_total` directly for `rate()`.
- `gateway_replica_capacity_tokens{replica}` gauge (num_gpu_blocks x block_size)
A replica gauge whose value the last scrape did not report is removed, not set to 0.
Admission (the gateway queue, gateway.admission; present with admission off too):
- `gateway_admission_queued{class}` gauge: requests waiting in the gateway, per class
- `gateway_admission_wait_seconds{class}` histogram: time each admitted request waited
  (0 for one that went at once)
- `gateway_admission_shed_total{reason}` counter: requests answered 429 by the queue
  (tenant_share, wait_limit, queue_full, displaced, wait_timeout)
- `gateway_admission_abandoned_total{class}` counter: clients that left while queued
- `gateway_admission_admitted_tokens_total{tenant}` counter: estimated prompt tokens
  admitted per tenant (the unit fair shares are counted in)

The process (prometheus_client's collectors on this registry; `PROCESS_METRICS`):
- `process_cpu_seconds_total`, `process_resident_memory_bytes`,
  `process_virtual_memory_bytes`, `process_open_fds`, `process_max_fds`,
  `process_start_time_seconds`: the gateway process's CPU, memory and descriptors
- `python_gc_objects_collected_total{generation}`,
  `python_gc_objects_uncollectable_total{generation}`,
  `python_gc_collections_total{generation}`: the cyclic collector's work
- `python_info{implementation,major,minor,patchlevel,version}`: operator only
No family has `*_created` samples (`OwnRegistry`).

Label values: `None` becomes "none"; status is the HTTP status as a string.

Who reads what: families with a `tenant` label, and those that tell how much of the
prompts the cache shares (cached, predicted, best-available tokens, the cached ratio, the
engines' prefix-cache hits, hygiene findings), are tenant-scoped: only the operator (no
keys, or an admin key) reads them; every other reader gets the fleet-wide families that
gateway.usage.exposure lists (a family added here is private until it is listed there).

Cardinality: every label value is bounded by configuration or by a fixed set, never by what
a client sends. `model` is a model some replica serves, or "unknown" (the request path
replaces a name no replica lists before the record is made: `UNKNOWN_MODEL`), so at most
(served models + 2); `replica`: the replicas in the fleet now (configured, or an
InferencePool's live pods) + "none" + "departed"; `tenant`: the configured API keys'
tenants + "none"; `route`: the policies' reasons + "forward" (about 10); `status`: HTTP
statuses the gateway or an engine answered (at most 500 values, 10-20 in practice);
`reason`, `kind`, `severity`, `sink`, `class`: fixed sets in the code. So the request series are at
most models x replicas x tenants x routes x statuses, whatever clients send.

Departures: `remove_replica(name)` drops every series labelled with that replica, in every
family of this registry that has a `replica` label (the upstream counters' too), and the
cached children that point at them; a request that ends after its replica left is counted
under `replica="departed"` (`live`), so churn never makes a series again for a name that
is gone. The replica series are bounded by the live fleet + 2, whatever the churn.

Speed: `observe` runs once per request. `.labels()` costs a lock and a dict lookup per
metric, so the children for one label tuple are resolved once and cached in a dict keyed
by that tuple (bounded by label cardinality, like the registry itself).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Final, NamedTuple

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

from gateway.routing.decision import MOVE_REASONS
from gateway.usage.admission_metrics import AdmissionMetrics
from gateway.usage.record import DEPARTED, NONE_LABEL, UsageRecord
from gateway.usage.replica_metrics import ReplicaMetrics
from gateway.usage.snapshot import EngineSnapshot

# The process's own families (prometheus_client's Process, GC and Platform collectors, on
# Linux), as exposed; fleet-wide but `python_info` (gateway.usage.exposure).
PROCESS_METRICS: Final[tuple[str, ...]] = (
    "process_cpu_seconds_total", "process_virtual_memory_bytes",
    "process_resident_memory_bytes", "process_start_time_seconds", "process_open_fds",
    "process_max_fds", "python_gc_objects_collected_total",
    "python_gc_objects_uncollectable_total", "python_gc_collections_total", "python_info",
)
UNKNOWN_MODEL: Final = "unknown"  # the label of every model name no replica serves

DOCUMENTED_METRICS: Final[tuple[str, ...]] = (
    "gateway_requests_total",
    "gateway_prompt_tokens_total",
    "gateway_cached_tokens_total",
    "gateway_predicted_cached_tokens_total",
    "gateway_best_available_tokens_total",
    "gateway_completion_tokens_total",
    "gateway_records_without_cached_tokens_total",
    "gateway_ttft_seconds",
    "gateway_non_streamed_latency_seconds",
    "gateway_request_latency_seconds",
    "gateway_request_prompt_tokens",
    "gateway_cached_ratio",
    "gateway_endpoint_requests_total",
    "gateway_endpoint_prompt_tokens_total",
    "gateway_endpoint_cached_tokens_total",
    "gateway_routing_decisions_total",
    "gateway_route_moves_total",
    "gateway_hygiene_findings_total",
    "gateway_usage_sink_errors_total",
    "gateway_usage_records_dropped_total",
    "gateway_replica_healthy",
    "gateway_replica_in_flight",
    "gateway_replica_kv_cache_usage",
    "gateway_replica_requests_waiting",
    "gateway_replica_requests_running",
    "gateway_replica_prefix_cache_hits_tokens",
    "gateway_replica_prefix_cache_queries_tokens",
    "gateway_replica_capacity_tokens",
    "gateway_admission_queued",
    "gateway_admission_wait_seconds",
    "gateway_admission_shed_total",
    "gateway_admission_abandoned_total",
    "gateway_admission_admitted_tokens_total",
)

_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_LATENCY_BUCKETS = (*_SECONDS_BUCKETS, 120.0, 300.0, 600.0)
_PROMPT_BUCKETS = tuple(float(2**i) for i in range(5, 18))  # 32 .. 131072
_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)

_TOKEN_LABELS = ("model", "replica", "tenant", "route")
_HIST_LABELS = ("model", "replica")


def _label(value: str | None) -> str:
    return NONE_LABEL if value is None else value


class _TokenChildren(NamedTuple):
    prompt: Counter
    cached: Counter
    predicted: Counter
    best: Counter
    completion: Counter


class _HistChildren(NamedTuple):
    ttft: Histogram
    non_streamed: Histogram
    latency: Histogram
    prompt: Histogram
    ratio: Histogram


class GatewayMetrics:
    def __init__(self, live: Callable[[str], bool] | None = None) -> None:
        # whether a replica is in the fleet now (None: every name is, a fleet that never
        # changes); a record of one that left is labelled DEPARTED
        self.live = live
        r = self.registry = OwnRegistry(auto_describe=True)
        # the gateway process itself: CPU, memory, descriptors, GC (PROCESS_METRICS)
        ProcessCollector(registry=r)
        GCCollector(registry=r)
        PlatformCollector(registry=r)
        self._requests = Counter(
            "gateway_requests", "Proxied requests by outcome.",
            (*_TOKEN_LABELS, "status"), registry=r,
        )  # fmt: skip
        self._prompt = Counter(
            "gateway_prompt_tokens", "Prompt tokens the engines reported.", _TOKEN_LABELS,
            registry=r,
        )  # fmt: skip
        self._cached = Counter(
            "gateway_cached_tokens",
            "Prompt tokens the engines reported as served from the prefix cache.",
            _TOKEN_LABELS, registry=r,
        )  # fmt: skip
        self._predicted = Counter(
            "gateway_predicted_cached_tokens",
            "Cached prompt tokens the gateway predicted on the chosen replica.",
            _TOKEN_LABELS, registry=r,
        )  # fmt: skip
        self._best = Counter(
            "gateway_best_available_tokens",
            "Cached prompt tokens the best replica could have given.", _TOKEN_LABELS,
            registry=r,
        )  # fmt: skip
        self._completion = Counter(
            "gateway_completion_tokens", "Completion tokens the engines reported.",
            _TOKEN_LABELS, registry=r,
        )  # fmt: skip
        self._without_cached = Counter(
            "gateway_records_without_cached_tokens",
            "Requests whose usage had prompt_tokens but no cached_tokens "
            "(start vLLM with --enable-prompt-tokens-details).",
            ("replica",), registry=r,
        )  # fmt: skip
        self._ttft = Histogram(
            "gateway_ttft_seconds", "Time to the first byte of a streamed answer.",
            _HIST_LABELS, registry=r, buckets=_SECONDS_BUCKETS,
        )  # fmt: skip
        self._non_streamed = Histogram(
            "gateway_non_streamed_latency_seconds",
            "Latency of a non-streamed answer until its last byte.", _HIST_LABELS,
            registry=r, buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self._latency = Histogram(
            "gateway_request_latency_seconds", "Request latency until the last byte.",
            _HIST_LABELS, registry=r, buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self._prompt_hist = Histogram(
            "gateway_request_prompt_tokens", "Prompt length in tokens per request.", _HIST_LABELS,
            registry=r, buckets=_PROMPT_BUCKETS,
        )  # fmt: skip
        self._ratio = Histogram(
            "gateway_cached_ratio", "cached_tokens / prompt_tokens per request.",
            _HIST_LABELS, registry=r, buckets=_RATIO_BUCKETS,
        )  # fmt: skip
        self._endpoint_requests = Counter(
            "gateway_endpoint_requests", "Proxied requests by inference API and status.",
            ("endpoint", "status"), registry=r,
        )  # fmt: skip
        self._endpoint_prompt = Counter(
            "gateway_endpoint_prompt_tokens", "Prompt tokens by inference API.",
            ("endpoint",), registry=r,
        )  # fmt: skip
        self._endpoint_cached = Counter(
            "gateway_endpoint_cached_tokens", "Engine-reported cached tokens by inference API.",
            ("endpoint",), registry=r,
        )  # fmt: skip
        self._routes = Counter(
            "gateway_routing_decisions", "Routing decisions by reason.", ("reason",),
            registry=r,
        )  # fmt: skip
        # One series per reason, all present from the start (a fixed set: the router's
        # MOVE_REASONS), so a rate() over them never starts from a missing series.
        self._moves = Counter(
            "gateway_route_moves", "Sessions and implicit conversations moved off the "
            "replica they were on, by reason.", ("reason",), registry=r,
        )  # fmt: skip
        self._move_children = {m: self._moves.labels(m) for m in MOVE_REASONS}
        self._hygiene = Counter(
            "gateway_hygiene_findings", "Prompt-hygiene findings.", ("kind", "severity"),
            registry=r,
        )  # fmt: skip
        self._sink_errors = Counter(
            "gateway_usage_sink_errors", "Failed usage-sink writes.", ("sink",), registry=r
        )
        self._dropped = Counter(
            "gateway_usage_records_dropped",
            "Usage records a sink lost (queue full or failed write).", ("sink",), registry=r,
        )  # fmt: skip
        self._replicas = ReplicaMetrics(r)
        self._admission = AdmissionMetrics(r, _SECONDS_BUCKETS)
        self._request_children: dict[tuple[str, ...], Counter] = {}
        self._token_children: dict[tuple[str, ...], _TokenChildren] = {}
        self._hist_children: dict[tuple[str, str], _HistChildren] = {}
        self._without_children: dict[str, Counter] = {}
        self._route_children: dict[str, Counter] = {}
        self._hygiene_children: dict[tuple[str, str], Counter] = {}
        self._endpoint_children: dict[tuple[str, str], tuple[Counter, Counter, Counter]] = {}

    # -- per request -------------------------------------------------------------------

    def observe(self, rec: UsageRecord, departed: bool = False) -> None:
        """`departed`: its replica left (Recorder.record), whatever the name is now."""
        model = rec.model or NONE_LABEL
        replica = _label(rec.replica)
        if departed or not self.live_or_none(rec.replica):
            replica = DEPARTED
        tokens_key = (model, replica, _label(rec.tenant), _label(rec.route))
        req_key = (*tokens_key, str(rec.status))
        req = self._request_children.get(req_key)
        if req is None:
            req = self._request_children[req_key] = self._requests.labels(*req_key)
        req.inc()

        tok = self._token_children.get(tokens_key)
        if tok is None:
            tok = self._token_children[tokens_key] = _TokenChildren(
                *(m.labels(*tokens_key) for m in
                  (self._prompt, self._cached, self._predicted, self._best, self._completion))
            )  # fmt: skip
        # P/D: cached = the prefill replica's own hits; tokens it pulled back from a decoder
        # are neither hits nor misses (gateway_pd_pulled_tokens_total counts them)
        prompt, (own_prompt, cached, _) = rec.prompt_tokens, rec.cache_split()
        if prompt:
            tok.prompt.inc(prompt)
        if cached:
            tok.cached.inc(cached)
        if rec.predicted_cached_tokens:
            tok.predicted.inc(rec.predicted_cached_tokens)
        if rec.best_available_tokens:
            tok.best.inc(rec.best_available_tokens)
        if rec.completion_tokens:
            tok.completion.inc(rec.completion_tokens)

        endpoint = rec.endpoint_kind
        ep_key = (endpoint, str(rec.status))
        ep = self._endpoint_children.get(ep_key)
        if ep is None:  # bounded: endpoint kinds x HTTP status codes
            ep = self._endpoint_children[ep_key] = (
                self._endpoint_requests.labels(*ep_key), self._endpoint_prompt.labels(endpoint),
                self._endpoint_cached.labels(endpoint))
        ep[0].inc()
        if prompt:
            ep[1].inc(prompt)
        if cached:
            ep[2].inc(cached)

        hist_key = (model, replica)
        hist = self._hist_children.get(hist_key)
        if hist is None:
            hist = self._hist_children[hist_key] = _HistChildren(
                *(m.labels(*hist_key) for m in
                  (self._ttft, self._non_streamed, self._latency, self._prompt_hist,
                   self._ratio))
            )  # fmt: skip
        if not rec.stream:
            hist.non_streamed.observe(rec.latency_ms / 1000.0)
        elif rec.ttft_ms is not None:
            hist.ttft.observe(rec.ttft_ms / 1000.0)
        hist.latency.observe(rec.latency_ms / 1000.0)
        if prompt is not None:
            hist.prompt.observe(prompt)
            if cached is None:
                without = self._without_children.get(replica)
                if without is None:
                    without = self._without_children[replica] = self._without_cached.labels(
                        replica
                    )
                without.inc()
            elif own_prompt:
                hist.ratio.observe(min(1.0, cached / own_prompt))

    def live_or_none(self, replica: str | None) -> bool:
        """No replica (the gateway answered), or one in the fleet now."""
        return replica is None or self.live is None or self.live(replica)

    # -- request path events -----------------------------------------------------------

    def route_decision(self, reason: str) -> None:
        child = self._route_children.get(reason)
        if child is None:
            child = self._route_children[reason] = self._routes.labels(reason)
        child.inc()

    def route_move(self, reason: str) -> None:
        child = self._move_children.get(reason)
        if child is not None:  # anything else is not a reason the router gives
            child.inc()

    # -- admission ---------------------------------------------------------------------

    # The admission queue's families live in admission_metrics.py; gateway.admission
    # calls these.
    def admission_queued(self, cls: str, waiting: int) -> None:
        self._admission.queued(cls, waiting)

    def admission_admitted(self, cls: str, tenant: str, tokens: int, waited_s: float) -> None:
        self._admission.admitted(cls, tenant, tokens, waited_s)

    def admission_shed(self, reason: str) -> None:
        self._admission.shed(reason)

    def admission_abandoned(self, cls: str) -> None:
        self._admission.abandoned(cls)

    # -- request path outcomes ---------------------------------------------------------

    def hygiene_finding(self, kind: str, severity: str) -> None:
        key = (kind, severity)
        child = self._hygiene_children.get(key)
        if child is None:
            child = self._hygiene_children[key] = self._hygiene.labels(*key)
        child.inc()

    def sink_error(self, sink: str) -> None:
        self._sink_errors.labels(sink).inc()

    def records_dropped(self, sink: str, count: int) -> None:
        self._dropped.labels(sink).inc(count)

    # -- replicas ----------------------------------------------------------------------

    def replica_state(
        self, name: str, healthy: bool, in_flight: int, snapshot: EngineSnapshot | None
    ) -> None:
        """After each health probe / scrape (replica_metrics.py)."""
        self._replicas.state(name, healthy, in_flight, snapshot)

    def remove_replica(self, name: str) -> None:
        """The replica left the fleet: every series labelled with it goes, in every family
        of the registry with a `replica` label, and the cached children of those series
        (a name that comes back starts from new ones)."""
        for family in replica_families(self.registry):
            family.remove_by_labels({"replica": name})
        _drop_keys(self._request_children, name)
        _drop_keys(self._token_children, name)
        _drop_keys(self._hist_children, name)
        self._without_children.pop(name, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# prometheus_client's own `*_created` sample types (a gauge may end in `_created` too)
_CREATED_TYPES: Final = frozenset({"counter", "histogram", "summary"})


class OwnRegistry(CollectorRegistry):
    """A registry whose families come without their `*_created` samples: half the series,
    and no dashboard reads them. `prometheus_client.disable_created_metrics()` would do
    it for every registry of the process (a library's, a test's): this drops them from
    this registry's output only, as it is collected (a /metrics render or a view of it,
    gateway.usage.exposure)."""

    def collect(self) -> Iterator[Metric]:
        for family in super().collect():
            if family.type in _CREATED_TYPES:
                created = family.name + "_created"
                family.samples = [s for s in family.samples if s.name != created]
            yield family


def _drop_keys(cache: dict[Any, Any], replica: str) -> None:
    """Drop a cache's children whose label tuple names `replica` (its second label)."""
    for key in [k for k in cache if k[1] == replica]:
        del cache[key]


def replica_families(registry: CollectorRegistry) -> list[MetricWrapperBase]:
    """Every family registered on `registry` with a `replica` label: a family added later,
    here or elsewhere on the gateway's registry, is found without a list to keep."""
    collectors = list(registry._collector_to_names)  # no public way to list them
    return [c for c in collectors
            if isinstance(c, MetricWrapperBase) and "replica" in c._labelnames]
