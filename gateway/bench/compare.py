"""`gateway-bench compare`: the same workload through the gateway under several policies.

For each policy, in turn and from cold: start `gateway sim` (N replicas, the preset's KV
size and speed, timing comments on) and `gateway serve --policy P` in front of it with a
usage log, replay the workload, stop the gateway (flushing its log), tokenize the recorded
requests on a replica for the exact bound, stop the simulator. Fresh processes per policy
keep caches cold and equal. Then one side-by-side table, a JSON result and a PNG chart.

With `backends` (`compare --backend URL ...`) the policies run against those replicas
instead (real vLLM): no simulator is started, the server is probed first (model,
`max_model_len`, tool flags, block size: `gateway.bench.server`) and every replica's prefix
cache is reset before each policy (`gateway.bench.backends`); where it cannot be, compare
stops and says why, unless `allow_dirty_cache`.

Sessions are named as `session_ids` says (header, prompt_cache_key, user or none); a
column `policy@how` runs that policy with sessions named another way. Unless told
otherwise, `prefix` also runs with the other case (`prefix@none` when sessions are named,
`prefix@header` when they are not), so neither can regress unseen.

Everything started is stopped in `finally` (context managers); every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TextIO

import orjson

from gateway.admission.config import AdmissionConfig
from gateway.bench import explain
from gateway.bench.analysis import analyse, read_usage_log
from gateway.bench.apis import Api
from gateway.bench.backends import contamination_notice, reset_caches
from gateway.bench.checks import format_checks, quality_checks, tiny_note
from gateway.bench.failures import format_reasons
from gateway.bench.groups import groups_table
from gateway.bench.pdfleet import PD, fleet_args, sim_flags
from gateway.bench.pdfleet import gateway_env as pd_env
from gateway.bench.presets import BLOCK_SIZE, Preset
from gateway.bench.procs import Managed, free_ports, gateway_command, local_redis
from gateway.bench.runner import (
    SESSION_IDS,
    RequestRecord,
    RunOptions,
    SessionIds,
    auth_keys,
    run_workload,
)
from gateway.bench.server import ServerFacts, probe
from gateway.bench.session import ServerLimits, sample_body
from gateway.bench.table import replica_table, summary_table
from gateway.bench.workload import build_workload
from gateway.usage.config import UsageConfig


@dataclass(frozen=True, kw_only=True)
class CompareOptions:
    preset: Preset
    policies: tuple[str, ...]
    out_dir: Path
    model: str = "sim-model"
    seed: int = 0
    max_wall_s: float = 600.0  # per policy run
    progress: bool = True
    extra_gateway_args: tuple[str, ...] = ()
    backends: tuple[str, ...] = ()  # replicas to use instead of starting the simulator
    time_scale: float | None = None  # default: 1 / the preset's speed (1 with backends)
    allow_dirty_cache: bool = False
    api: Api = "chat"
    session_ids: SessionIds = "header"
    gateways: int = 1  # gateway instances per column, behind a round-robin client
    shared_state: bool = True  # with several: share routing state through a local Redis
    pd: tuple[int, int] | None = None  # +pd columns: prefill and decode replicas
    pd_reuse: bool = False  # +pd columns: the decoder's KV pulled back on the next turn


class DirtyCacheError(RuntimeError):
    """Caches could not be reset between policies on user-run replicas."""


QUEUE = "+queue"  # a column suffix: the same policy with the admission queue on
# with it, the queue without the agent reservation (`[admission] agent_reserve_max_s = 0`)
NO_RESERVE = "+noreserve"
# (`+pd`, gateway/bench/pdfleet.py: the same policy on a prefill/decode fleet)
MIN_RECHECK_S = 0.001  # the queue's re-examination period, however fast the simulator
# the replicas' /metrics read no more often than this (wall seconds), however fast the
# simulator: the gateway parses each scrape (a few ms of CPU on this machine's 2 cores)
MIN_SCRAPE_S = 0.25
# (`high`; the lower classes half of it: one step, so a newcomer starts within ~a step)


def split_column(column: str, default: SessionIds) -> tuple[str, SessionIds]:
    """`prefix@none` -> ("prefix", "none"); `prefix` -> ("prefix", default);
    `prefix+queue@none` -> ("prefix", "none") (`queued(column)` says the queue is on,
    `pd_column(column)` the P/D fleet: `prefix+pd`, `prefix+queue+pd`)."""
    policy, _, how = column.partition("@")
    policy, *flags = policy.split("+")
    unknown = [f for f in flags if f not in (QUEUE[1:], PD, NO_RESERVE[1:])]
    if unknown:
        raise ValueError(f"unknown column flag +{unknown[0]} in {column!r}; choose from "
                         f"{QUEUE}, +{PD}, {NO_RESERVE}")
    for known in SESSION_IDS:
        if how == known:
            return policy, known
    if how:
        raise ValueError(f"unknown session naming {how!r} in {column!r}; choose from "
                         f"{', '.join(SESSION_IDS)}")
    return policy, default


def queued(column: str) -> bool:
    """The column runs with `[admission] enabled` (`prefix+queue`, `prefix+queue@none`)."""
    return QUEUE[1:] in column.partition("@")[0].split("+")[1:]


def pd_column(column: str) -> bool:
    """The column runs on a prefill/decode fleet (`prefix+pd`)."""
    return PD in column.partition("@")[0].split("+")[1:]


def gateway_env(column: str, preset: Preset, time_scale: float = 1.0,
                replicas: tuple[str, ...] = ()) -> dict[str, str]:
    """Settings every gateway of a column gets besides the usage log: the workload's
    tenants as API keys (any class allowed, so the header decides) and the queue: on in a
    `+queue` column, pinned off in every other, so a column means
    the same whatever the default.
    No engine setting of the preset (`--max-num-seqs`, `--max-num-batched-tokens`) is
    copied into the gateway: it learns each replica's room from the engine's scrapes, as
    a user's gateway does.
    The queue's waits are wall seconds; against a simulator running `1 / time_scale`
    times faster they shrink with it, so its limits mean the same simulated time; so does
    every column's scrape interval (`scaled_signals`)."""
    env: dict[str, str] = dict(scaled_signals(time_scale))
    workload = preset.workload
    if workload.tenants:
        env["GATEWAY_AUTH__KEYS"] = auth_keys(workload.tenants)
        env["GATEWAY_ADMISSION__DEFAULT_PRIORITY_CAP"] = "high"
    env["GATEWAY_ADMISSION__ENABLED"] = "true" if queued(column) else "false"
    if queued(column):
        if preset.scheduling_policy == "priority" and replicas:
            # replicas named as `--backend URL` names them: host:port
            env["GATEWAY_ADMISSION__PRIORITY_REPLICAS"] = ",".join(
                u.split("//", 1)[-1] for u in replicas)
        env.update(scaled_waits(time_scale))
        if NO_RESERVE[1:] in column.partition("@")[0].split("+")[1:]:
            env["GATEWAY_ADMISSION__AGENT_RESERVE_MAX_S"] = "0"
    return env


def scaled_signals(time_scale: float,
                   exported: Mapping[str, str] | None = None) -> dict[str, str]:
    """The gateway's scrape interval (`usage.scrape_interval_s`, 5 wall seconds by
    default) scaled to a simulator running `1 / time_scale` times faster, as a
    GATEWAY_USAGE__* setting (none at 1.0), not below `MIN_SCRAPE_S`: a user's gateway
    reads its engines' running and waiting counts and KV usage every 5 seconds of their
    time, and against a simulator 5 times faster an unscaled interval showed them 25
    simulated seconds apart, longer than a whole overload burst of the agent preset
    (issue 36: the queue held a fleet to figures that old). None when the caller exported
    an interval (`exported`, default the environment the gateways inherit): it wins."""
    exported = os.environ if exported is None else exported
    if time_scale == 1.0 or "GATEWAY_USAGE__SCRAPE_INTERVAL_S" in exported:
        return {}
    default = UsageConfig().scrape_interval_s
    return {"GATEWAY_USAGE__SCRAPE_INTERVAL_S": f"{max(MIN_SCRAPE_S, default * time_scale):g}"}


def scaled_waits(time_scale: float) -> dict[str, str]:
    """The queue's default waits (wall seconds) scaled to a simulator running
    `1 / time_scale` times faster than real time, as GATEWAY_ADMISSION__* settings
    (none at 1.0: the defaults are meant)."""
    if time_scale == 1.0:
        return {}
    env: dict[str, str] = {}
    defaults = AdmissionConfig()
    for key in ("high_max_wait_s", "normal_max_wait_s", "low_max_wait_s",
                "own_replica_max_wait_s", "recheck_s", "share_half_life_s",
                "agent_reserve_max_s"):
        value = getattr(defaults, key) * time_scale
        if key == "recheck_s":
            value = max(value, MIN_RECHECK_S)
        env[f"GATEWAY_ADMISSION__{key.upper()}"] = f"{value:g}"
    return env


def default_columns(policies: tuple[str, ...], session_ids: SessionIds) -> tuple[str, ...]:
    """The policies asked for, plus `prefix` with sessions named the other way."""
    if "prefix" not in policies or any(p.startswith("prefix@") for p in policies):
        return policies
    other = "header" if session_ids == "none" else "none"
    return (*policies, f"prefix@{other}")


def sim_argv(preset: Preset, port: int, model: str, seed: int,
             extra: tuple[str, ...] = ()) -> list[str]:
    engine = [*(("--max-num-seqs", str(preset.max_num_seqs)) if preset.max_num_seqs else ()),
              *(("--max-num-batched-tokens", str(preset.max_num_batched_tokens))
                if preset.max_num_batched_tokens else ()),
              *(("--scheduling-policy", preset.scheduling_policy)
                if preset.scheduling_policy != "fcfs" else ())]
    return gateway_command(
        "sim", "--replicas", str(preset.replicas), "--port", str(port), "--model", model,
        "--kv-blocks", str(preset.kv_blocks), "--block-size", str(BLOCK_SIZE),
        "--max-model-len", str(preset.max_model_len), "--speed", str(preset.speed),
        "--seed", str(seed), "--timing-comments",
        # The workload sends tools; vLLM (and the simulator, like it) refuses them otherwise.
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", *engine, *extra,
    )


def run_policy(
    opts: CompareOptions, column: str, facts: ServerFacts | None = None
) -> dict[str, Any]:
    policy, session_ids = split_column(column, opts.session_ids)
    preset = opts.preset
    workload = build_workload(preset.workload)
    logs = opts.out_dir / "logs"
    usage_log = logs / f"usage-{column}.jsonl"
    usage_log.parent.mkdir(parents=True, exist_ok=True)
    usage_log.unlink(missing_ok=True)
    replicas: list[str]
    engines: contextlib.AbstractContextManager[Any]
    pd = opts.pd if pd_column(column) else None
    if pd is not None:
        preset = replace(preset, replicas=sum(pd))
    if opts.backends:
        replicas = list(opts.backends)
        engines = contextlib.nullcontext()
    else:
        port = free_ports(preset.replicas)
        replicas = [f"http://127.0.0.1:{port + i}" for i in range(preset.replicas)]
        engines = Managed(
            sim_argv(preset, port, opts.model, opts.seed,
                     () if pd is None else tuple(sim_flags(pd, opts.pd_reuse))),
            [u + "/health" for u in replicas],
            logs / f"sim-{column}.log",
        )
    model = facts.model if facts else opts.model
    limits = ServerLimits(
        max_model_len=facts.max_model_len, tool_choice=facts.tool_choice,
        chars_per_token=facts.chars_per_token,
    ) if facts else ServerLimits()
    scale = opts.time_scale or (1.0 if opts.backends else 1.0 / preset.speed)
    sharing = opts.gateways > 1 and opts.shared_state
    redis: contextlib.AbstractContextManager[str | None] = (
        local_redis(logs / f"redis-{column}.log") if sharing else contextlib.nullcontext())
    with engines, redis as redis_url, contextlib.ExitStack() as gateways:
        backends = fleet_args(replicas, pd)
        gw_urls: list[str] = []
        usage_logs: list[Path] = []
        for k in range(opts.gateways):
            gw_port = free_ports(1)
            gw_urls.append(f"http://127.0.0.1:{gw_port}")
            usage_logs.append(usage_log if k == 0 else
                              usage_log.with_name(f"usage-{column}-{k}.jsonl"))
            usage_logs[-1].unlink(missing_ok=True)
            env = {"GATEWAY_USAGE__LOG_PATH": str(usage_logs[-1]),
                   **gateway_env(column, preset, scale, tuple(replicas)),
                   **(pd_env(opts.pd_reuse, scale) if pd is not None else {})}
            if redis_url is not None:
                env["GATEWAY_REDIS__URL"] = redis_url
            gateways.enter_context(Managed(
                gateway_command(
                    "serve", "--host", "127.0.0.1", "--port", str(gw_port), "--policy",
                    policy, *backends, *opts.extra_gateway_args,
                ),
                [gw_urls[-1] + "/ready"],
                logs / (f"gateway-{column}.log" if k == 0 else f"gateway-{column}-{k}.log"),
                env=env,
            ))
        result = asyncio.run(
            run_workload(
                workload,
                RunOptions(
                    base_url=gw_urls[0], more_base_urls=tuple(gw_urls[1:]), model=model,
                    concurrency=preset.concurrency, time_scale=scale,
                    max_wall_s=opts.max_wall_s, progress=opts.progress,
                    label=f"{column:>12}", limits=limits, api=opts.api,
                    session_ids=session_ids,
                ),
            )
        )
        gateways.close()
        # The gateways are stopped here, so their usage logs are complete.
        _relabel(result.records, replicas)
        usage = [row for path in usage_logs for row in read_usage_log(path)]
        summary = analyse(
            result, len(replicas), tokenize_url=replicas[0], usage=usage,
            block_size=(facts.block_size if facts else None) or BLOCK_SIZE,
        )
    summary["policy"] = policy
    summary["queue"] = queued(column)
    summary["session_ids"] = session_ids
    summary["gateways"] = opts.gateways
    summary["shared_state"] = sharing
    summary["pd"] = None if pd is None else {"prefill": pd[0], "decode": pd[1],
                                              "reuse_decoder_kv": opts.pd_reuse}
    return summary


def _relabel(records: list[RequestRecord], urls: list[str]) -> None:
    """Name replicas by position (replica0..) instead of ports that change every run."""
    names: dict[str, str] = {}
    for i, url in enumerate(urls):
        names[url] = names[url.split("//", 1)[-1]] = f"replica{i}"
    for r in records:
        if r.replica is not None:
            r.replica = names.get(r.replica, r.replica)


def compare(opts: CompareOptions, out: TextIO | None = None) -> dict[str, Any]:
    out = out if out is not None else sys.stdout
    summaries: dict[str, dict[str, Any]] = {}
    facts = None
    if opts.backends:
        sample = sample_body(build_workload(opts.preset.workload))
        facts = asyncio.run(probe(opts.backends[0], None, opts.backends, sample=sample))
        ratio = f"{facts.chars_per_token:.2f}" if facts.chars_per_token else "unknown"
        print(f"replicas: model {facts.model}, max_model_len {facts.max_model_len}, "
              f"block size {facts.block_size}, {ratio} characters per token", file=out)
        for note in facts.notes:
            print(f"note: {note}", file=out)
    for policy in opts.policies:
        failed: dict[str, str] = {}
        if opts.backends:
            failed = asyncio.run(reset_caches(opts.backends))
            if failed and len(opts.policies) > 1:
                if not opts.allow_dirty_cache:
                    raise DirtyCacheError(contamination_notice(failed))
                print(f"warning: {contamination_notice(failed)}", file=out)
        summaries[policy] = run_policy(opts, policy, facts)
        # Fresh simulator processes per policy start cold; user-run replicas only if reset.
        summaries[policy]["cache_reset"] = not failed
    preset = opts.preset
    result: dict[str, Any] = {
        "preset": {**asdict(preset), "workload": asdict(preset.workload)},
        "policies": summaries,
        "checks": quality_checks(summaries, judged=judged(opts)),
    }
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    (opts.out_dir / "compare.json").write_bytes(
        orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS)
    )
    from gateway.bench.charts import compare_chart  # the extra: checked before the run

    chart = compare_chart(
        {p: s["turns"] for p, s in summaries.items()},
        summaries,
        opts.out_dir / "compare.png",
        title=f"preset {preset.name}: {preset.replicas} replicas x {preset.kv_blocks} KV blocks",
    )
    print(summary_table(summaries), file=out)
    for line in explain.legend(summaries, opts.session_ids):
        print(line, file=out)
    print(explain.PACING, file=out)
    print(file=out)
    print(replica_table(summaries), file=out)
    print(file=out)
    groups = groups_table(summaries)
    if groups:
        print(groups, file=out)
        print(file=out)
    for line in format_checks(result["checks"]):
        print(line, file=out)
    if preset.name == "tiny":
        print(tiny_note(summaries, preset), file=out)
    for policy, summary in summaries.items():
        if summary.get("error_reasons"):
            print(f"\nfailed requests under {policy}:", file=out)
            for line in format_reasons(summary["error_reasons"]):
                print(line, file=out)
    if preset.concurrency > 1:
        # The workload (prompts, replies) is the same for a seed; with sessions running at
        # once, which request meets which queue and eviction depends on timing.
        print(f"\n(seed {preset.workload.seed}: the same sessions and replies every run; with "
              f"{preset.concurrency} sessions at once the figures vary with timing, "
              "--concurrency 1 reproduces them exactly)", file=out)
    print(f"\nresults: {opts.out_dir / 'compare.json'}  chart: {chart}", file=out)
    return result


def judged(opts: CompareOptions) -> bool:
    """The targets are set for the simulated fleets of the sized presets (default, large,
    xl: a cache that holds half the working set); `tiny` is a smoke run, and a run against
    given replicas has their cache, not the preset's."""
    return opts.preset.name != "tiny" and not opts.backends
