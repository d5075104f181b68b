"""Agent-session workload generator (pure, seeded, deterministic).

A workload is a list of `SessionPlan`s. Each session belongs to an agent TYPE; every type
has a long system prompt and a set of tool schemas shared by all its sessions (the prefix
a cache-aware router should exploit). Type weights make some types POPULAR (many
sessions) and others UNPOPULAR, which is what exposes the hot-spot failure of routers that
chase the cache without looking at load.

A session is: a task message, then `turns` requests. Before every turn after the first
the agent appends the model's (real) previous reply and a tool result (usually
`tool_result_tokens`, sometimes `large_tool_result_tokens`). Some turns fan out into
parallel sibling calls that share the whole session prefix and differ only in a final
message. Every `compaction_every` turns the old middle of the history is replaced by a
summary (the prompt shrinks). Between turns the agent thinks (`think_time_s`, exponential)
and sometimes idles much longer. Sessions arrive over time (Poisson or staggered).

Agent programs (the `agent-tools` preset): with `gap_dist = "lognormal"` a gap between
turns is a tool call, drawn from a heavy-tailed lognormal (median `think_time_s`, shape
`gap_sigma`, at most `gap_max_s`: most calls take seconds, some much longer), from the
session's own seeded generator. With `subagents = k`, sessions come in programs of k
sub-agents that arrive together, share one agent type (its system prompt and tools) and
send one program header (`x-claude-code-session-id`, the program; `x-claude-code-agent-id`,
the sub-agent), each with its own conversation. `load` multiplies the offered load: the
sessions' count and their arrival rate (the run's span stays about the same).

Tenants and classes (the overload presets): each session belongs to a tenant (an API key
`sk-<tenant>`, dealt by `tenants` weights, so a tenant with 10x the weight arrives 10x as
often) and runs in one priority class (`x-gateway-priority`, dealt by `priorities`
weights). `only_tenants` keeps just those tenants' sessions, unchanged: the same tenant
run alone, for the "alone vs beside a flood" comparison.

Everything here is a function of `WorkloadConfig` (its `seed` included): the same config
gives byte-identical plans. Times are in workload seconds; the runner scales them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.bench.text import identifier, words


@dataclass(frozen=True, kw_only=True)
class AgentType:
    name: str
    system_tokens: int  # instructions in the system prompt
    tools: int  # number of tool schemas
    tool_tokens: int  # approximate size of one tool schema's description
    weight: float  # relative share of sessions


@dataclass(frozen=True, kw_only=True)
class WorkloadConfig:
    sessions: int = 24
    turns: int = 6
    seed: int = 0
    agent_types: tuple[AgentType, ...] = field(
        default_factory=lambda: DEFAULT_AGENT_TYPES
    )
    arrival: Literal["poisson", "staggered"] = "poisson"
    arrival_interval_s: float = 1.0  # mean gap between session starts
    task_tokens: int = 200
    think_time_s: float = 1.0  # mean think time between turns (exponential)
    idle_prob: float = 0.1  # chance that a gap is a long idle instead
    idle_s: float = 8.0
    tool_result_tokens: int = 400
    large_tool_result_tokens: int = 2000
    large_tool_result_prob: float = 0.1
    reply_tokens: int = 96  # max_tokens of every request
    fanout: int = 1  # requests per fan-out turn (1 = no siblings)
    fanout_prob: float = 0.25  # chance that a turn fans out
    compaction_every: int = 0  # 0 = never compact
    summary_tokens: int = 150
    hygiene_break: bool = False  # put a changing timestamp at the top of the system prompt
    # Every turn asks for a tool call (tool_choice "required"); the next turn sends the
    # assistant's call back with a `role: tool` message carrying the tool's output.
    tool_calls: bool = False
    # (tenant, weight) and (class, weight); empty: no API key / no priority header
    tenants: tuple[tuple[str, float], ...] = ()
    priorities: tuple[tuple[str, float], ...] = ()
    only_tenants: tuple[str, ...] = ()
    # gaps between turns: "exp" (think time, sometimes an idle) or "lognormal" (tool calls)
    gap_dist: Literal["exp", "lognormal"] = "exp"
    gap_sigma: float = 1.2  # the lognormal's shape (its median is think_time_s)
    gap_max_s: float = 60.0  # the longest lognormal gap (the bound on a session's span)
    subagents: int = 1  # sessions per agent program (1: no program header)
    load: float = 1.0  # offered load multiplier: sessions and arrival rate


DEFAULT_AGENT_TYPES: tuple[AgentType, ...] = (
    AgentType(name="coder", system_tokens=2400, tools=8, tool_tokens=140, weight=0.55),
    AgentType(name="researcher", system_tokens=1600, tools=5, tool_tokens=120, weight=0.25),
    AgentType(name="support", system_tokens=1200, tools=4, tool_tokens=100, weight=0.12),
    AgentType(name="analyst", system_tokens=900, tools=3, tool_tokens=100, weight=0.08),
)


@dataclass(frozen=True, kw_only=True)
class AgentPrompt:
    """What every session of one agent type shares."""

    agent: str
    system: str
    tools: tuple[dict[str, Any], ...]


@dataclass(frozen=True, kw_only=True)
class TurnPlan:
    index: int
    delay_s: float  # wait after the previous turn's reply (0 for the first turn)
    tool_result: str  # appended before this turn ("" for the first turn)
    siblings: tuple[str, ...]  # final messages of the parallel sibling calls
    compact: bool  # replace the old history by `summary` before this turn
    summary: str
    max_tokens: int


@dataclass(frozen=True, kw_only=True)
class SessionPlan:
    session_id: str
    agent: str
    start_s: float
    task: str
    turns: tuple[TurnPlan, ...]
    tenant: str | None = None
    priority: str | None = None
    program: str | None = None  # its agent program (x-claude-code-session-id), if any
    agent_id: str | None = None  # its sub-agent in that program (x-claude-code-agent-id)


@dataclass(frozen=True, kw_only=True)
class Workload:
    config: WorkloadConfig
    prompts: dict[str, AgentPrompt]
    sessions: tuple[SessionPlan, ...]

    def request_count(self) -> int:
        return sum(1 + len(t.siblings) for s in self.sessions for t in s.turns)


def agent_prompt(agent: AgentType, seed: int) -> AgentPrompt:
    base = f"{seed}:{agent.name}"
    system = (
        f"You are the {agent.name} agent. Follow the operating manual below.\n\n"
        + words(f"{base}:system", agent.system_tokens)
    )
    tools = []
    for i in range(agent.tools):
        tseed = f"{base}:tool:{i}"
        params = {
            identifier(f"{tseed}:p{j}"): {
                "type": "string",
                "description": words(f"{tseed}:pd{j}", 12),
            }
            for j in range(3)
        }
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": identifier(tseed),
                    "description": words(f"{tseed}:d", max(agent.tool_tokens - 60, 10)),
                    "parameters": {
                        "type": "object",
                        "properties": params,
                        "required": sorted(params)[:1],
                    },
                },
            }
        )
    return AgentPrompt(agent=agent.name, system=system, tools=tuple(tools))


def _tool_result(cfg: WorkloadConfig, rng: random.Random, seed: str) -> str:
    large = rng.random() < cfg.large_tool_result_prob
    size = cfg.large_tool_result_tokens if large else cfg.tool_result_tokens
    size = max(1, int(size * rng.uniform(0.7, 1.3)))
    payload = {"status": "ok", "output": words(seed, size)}
    return "Tool result:\n" + json.dumps(payload)


def _gap(cfg: WorkloadConfig, rng: random.Random) -> float:
    if cfg.gap_dist == "lognormal":  # a tool call: heavy-tailed, bounded (module docstring)
        if cfg.think_time_s <= 0:
            return 0.0
        return min(cfg.gap_max_s, rng.lognormvariate(math.log(cfg.think_time_s), cfg.gap_sigma))
    if rng.random() < cfg.idle_prob:
        return cfg.idle_s * rng.uniform(0.5, 1.5)
    return rng.expovariate(1.0 / cfg.think_time_s) if cfg.think_time_s > 0 else 0.0


def _session(cfg: WorkloadConfig, index: int, agent: str, start_s: float) -> SessionPlan:
    sid = f"s{index:04d}-{agent}"
    seed = f"{cfg.seed}:{sid}"
    rng = random.Random(seed)
    turns = []
    for t in range(cfg.turns):
        fan = cfg.fanout > 1 and t > 0 and rng.random() < cfg.fanout_prob
        siblings = tuple(
            f"Parallel check {k + 1}: " + words(f"{seed}:t{t}:sib{k}", 40)
            for k in range(cfg.fanout - 1 if fan else 0)
        )
        compact = cfg.compaction_every > 0 and t > 0 and t % cfg.compaction_every == 0
        turns.append(
            TurnPlan(
                index=t,
                delay_s=_gap(cfg, rng) if t > 0 else 0.0,
                tool_result=_tool_result(cfg, rng, f"{seed}:t{t}:tool") if t > 0 else "",
                siblings=siblings,
                compact=compact,
                summary=(
                    "Summary of the work so far: " + words(f"{seed}:t{t}:sum", cfg.summary_tokens)
                    if compact
                    else ""
                ),
                max_tokens=cfg.reply_tokens,
            )
        )
    task = f"Task for session {sid}: " + words(f"{seed}:task", cfg.task_tokens)
    return SessionPlan(session_id=sid, agent=agent, start_s=start_s, task=task, turns=tuple(turns))


def _deal(mix: tuple[tuple[str, float], ...], n: int, seed: str) -> list[str | None]:
    if not mix:
        return [None] * n
    rng = random.Random(seed)
    names = [m for m, _ in mix]
    return list(rng.choices(names, weights=[w for _, w in mix], k=n))


def build_workload(cfg: WorkloadConfig) -> Workload:
    if cfg.sessions < 0 or cfg.turns < 1:
        raise ValueError("need sessions >= 0 and turns >= 1")
    if not cfg.agent_types:
        raise ValueError("need at least one agent type")
    if cfg.subagents < 1 or cfg.load <= 0 or cfg.gap_sigma < 0 or cfg.gap_max_s < 0:
        raise ValueError("need subagents >= 1, load > 0, gap_sigma >= 0, gap_max_s >= 0")
    rng = random.Random(f"{cfg.seed}:arrivals")
    names = [a.name for a in cfg.agent_types]
    weights = [a.weight for a in cfg.agent_types]
    count = round(cfg.sessions * cfg.load)
    interval = cfg.arrival_interval_s / cfg.load
    sub = cfg.subagents
    programs = -(-count // sub)  # sub-agents of a program share its agent type
    # Deal types by weight but guarantee every type at least one session when there is room,
    # so unpopular types are always present.
    agents = names[: min(len(names), programs)]
    agents += rng.choices(names, weights=weights, k=programs - len(agents))
    rng.shuffle(agents)
    # Dealt from their own seeds, so adding tenants or classes changes nothing else.
    tenants = _deal(cfg.tenants, count, f"{cfg.seed}:tenants")
    classes = _deal(cfg.priorities, count, f"{cfg.seed}:classes")
    sessions = []
    now = 0.0
    for i in range(count):
        agent = agents[i // sub]
        plan = _session(cfg, i, agent, now)
        if tenants[i] is not None or classes[i] is not None:
            plan = dataclasses.replace(plan, tenant=tenants[i], priority=classes[i])
        if sub > 1:
            plan = dataclasses.replace(plan, program=f"{cfg.seed}-p{i // sub:04d}-{agent}",
                                       agent_id=f"sub{i % sub}")
        if not cfg.only_tenants or plan.tenant in cfg.only_tenants:
            sessions.append(plan)
        if (i + 1) % sub:
            continue  # the program's next sub-agent arrives with it
        if cfg.arrival == "poisson":
            now += rng.expovariate(1.0 / interval) if interval else 0
        else:
            now += interval
    prompts = {a.name: agent_prompt(a, cfg.seed) for a in cfg.agent_types}
    return Workload(config=cfg, prompts=prompts, sessions=tuple(sessions))
