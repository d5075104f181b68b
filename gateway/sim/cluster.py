"""N simulated vLLM replicas in one process and one event loop: ``SimOptions`` + ``SimCluster``.

Each replica is independent (own engine, KV pool, cache, metrics, virtual clock) and served by
its own uvicorn server (httptools) on 127.0.0.1:port+i. The tokenizer is shared: it is
stateless apart from a memo. Used by ``gateway sim``, the gateway's embedded default backend
and the benchmarks::

    cluster = SimCluster(SimOptions(replicas=4, port=8100, speed=100))
    await cluster.start()      # binds every port or raises
    cluster.urls               # ["http://127.0.0.1:8100", ...]
    await cluster.stop()
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import uvicorn

from gateway.sim.app import ServeConfig, SimApp
from gateway.sim.connector import KvConnector, KvFabric, Role
from gateway.sim.engine import Engine, EngineConfig
from gateway.sim.kvpublish import KVEventsOptions, ReplicaEvents, zmq_context
from gateway.sim.replica import Replica
from gateway.sim.responses import CURRENT, Contract
from gateway.sim.steptime import StepTimeModel
from gateway.sim.tokenizer import Tokenizer
from gateway.sim.transfer import TransferConfig

# The tool-call parser a vLLM deployment for agents names with --enable-auto-tool-choice:
# hermes is vLLM's parser for the Qwen2.5 models the simulator impersonates by default.
AGENT_TOOL_CALL_PARSER: Final = "hermes"


@dataclass(frozen=True, kw_only=True)
class SimOptions:
    replicas: int = 2
    host: str = "127.0.0.1"
    port: int = 8100
    model: str = "Qwen/Qwen2.5-7B-Instruct"
    kv_blocks: int = 2048
    block_size: int = 16
    max_model_len: int = 32768
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    speed: float = 1.0
    seed: int = 0
    contract: Contract = CURRENT
    prompt_tokens_details: bool = True
    tool_call_parser: str | None = None  # set = --enable-auto-tool-choice --tool-call-parser
    # tool_choice "auto": the share of answers that call a tool. 0 by default: the
    # benchmarks send tools without a choice and their figures assume text answers
    # (`gateway serve`'s demo sets its own, [demo] tool_call_probability).
    tool_call_probability: float = 0.0
    dev_mode: bool = False
    force_include_usage: bool = False
    timing_comments: bool = False
    log_interval: float = 10.0
    deprecated_metrics: bool = False
    output_len: int = 64
    hash_seed: Literal["fixed", "random"] = "fixed"
    responses_store: bool = False
    step_time: StepTimeModel = field(default_factory=StepTimeModel)
    kv_events: KVEventsOptions | None = None  # publish KV events (vLLM --kv-events-config)
    # P/D: replica i takes roles[i], the last one repeating (none: every replica "both",
    # without a KV connector); the connector's timings.
    roles: tuple[Role, ...] = ()
    transfer: TransferConfig = field(default_factory=TransferConfig)

    def role(self, i: int) -> Role:
        roles = self.roles
        return roles[min(i, len(roles) - 1)] if roles else "both"

    def __post_init__(self) -> None:
        checks = {
            "replicas must be >= 1": self.replicas >= 1,
            "port range must lie within 1..65535": self.port > 0
            and self.port + self.replicas - 1 <= 65535,
            "kv_blocks must be >= 2": self.kv_blocks >= 2,
            "block_size must be >= 1": self.block_size >= 1,
            "max_model_len must be >= 2": self.max_model_len >= 2,
            "max_num_batched_tokens must be >= 1": self.max_num_batched_tokens >= 1,
            "max_num_seqs must be >= 1": self.max_num_seqs >= 1,
            "speed must be > 0": self.speed > 0,
            "log_interval must be > 0": self.log_interval > 0,
            "output_len must be >= 1": self.output_len >= 1,
            "tool_call_probability must lie within 0..1": 0 <= self.tool_call_probability <= 1,
            "KV-event ports must lie within 1..65535": self.kv_events is None
            or 0 < self.kv_events.port <= 65535 - 2 * self.replicas + 1,
        }
        for message, ok in checks.items():
            if not ok:
                raise ValueError(message)


class SimCluster:
    def __init__(self, options: SimOptions) -> None:
        self.options = options
        self.tokenizer = Tokenizer()
        self.replicas: list[Replica] = []
        self._servers: list[uvicorn.Server] = []
        self._events: list[ReplicaEvents] = []
        self._zmq: Any = None
        self.fabric = KvFabric()  # the P/D replicas' side channel, in this process

    @property
    def urls(self) -> list[str]:
        o = self.options
        return [f"http://{o.host}:{o.port + i}" for i in range(o.replicas)]

    async def start(self) -> None:
        o = self.options
        try:
            for i in range(o.replicas):
                engine = Engine(
                    EngineConfig(
                        num_gpu_blocks=o.kv_blocks,
                        block_size=o.block_size,
                        max_model_len=o.max_model_len,
                        max_num_batched_tokens=o.max_num_batched_tokens,
                        max_num_seqs=o.max_num_seqs,
                        scheduling_policy=o.scheduling_policy,
                        output_len=o.output_len,
                        seed=o.seed,
                        replica=i,
                        hash_seed=o.hash_seed,
                        step_time=o.step_time,
                        kv_events=o.kv_events is not None,
                        kv_connector=o.role(i) != "both",
                    ),
                    self.tokenizer,
                )
                replica = Replica(
                    f"[{o.host}:{o.port + i}]", engine, o.speed, o.seed * 7919 + i, o.log_interval
                )
                sources = None
                if o.kv_events is not None:
                    if self._zmq is None:
                        self._zmq = zmq_context()
                    pub = o.kv_events.port + 2 * i
                    events = ReplicaEvents(self._zmq, engine, o.host, pub, pub + 1, o.kv_events)
                    self._events.append(events)
                    replica.after_step = events.after_step
                    sources = events.sources
                replica.start()
                self.replicas.append(replica)
                connector = None if o.role(i) == "both" else KvConnector(
                    replica, self.fabric, o.transfer, role=o.role(i), host=o.host,
                    port=o.port + i, usage_from_prefill=o.contract == "0.32")
                app = SimApp(
                    replica,
                    self.tokenizer,
                    ServeConfig(
                        model=o.model,
                        max_model_len=o.max_model_len,
                        contract=o.contract,
                        prompt_tokens_details=o.prompt_tokens_details,
                        tool_call_parser=o.tool_call_parser,
                        tool_call_probability=o.tool_call_probability,
                        seed=o.seed,
                        dev_mode=o.dev_mode,
                        force_include_usage=o.force_include_usage,
                        timing_comments=o.timing_comments,
                        deprecated_metrics=o.deprecated_metrics,
                        responses_store=o.responses_store,
                        kv_event_sources=sources,
                    ),
                    connector,
                )
                config = uvicorn.Config(
                    app,
                    host=o.host,
                    port=o.port + i,
                    http="httptools",
                    loop="none",
                    lifespan="off",
                    access_log=False,
                    log_level="warning",
                    timeout_keep_alive=30,
                    backlog=2048,
                )
                config.load()
                server = uvicorn.Server(config)
                # Driven without Server.serve(): that would install per-server signal
                # handlers; the owner of the loop handles signals for all replicas.
                server.lifespan = config.lifespan_class(config)
                try:
                    await server.startup()
                except SystemExit:  # uvicorn exits the process when it cannot bind
                    raise OSError(f"cannot bind {o.host}:{o.port + i}") from None
                if server.should_exit:
                    raise OSError(f"cannot bind {o.host}:{o.port + i}")
                self._servers.append(server)
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        servers, self._servers = self._servers, []
        for replica in self.replicas:
            await replica.stop()
        self.replicas = []
        await asyncio.gather(*(s.shutdown() for s in servers), return_exceptions=True)
        events, self._events = self._events, []
        for e in events:
            await e.close()
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None

