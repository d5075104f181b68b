"""``gateway sim``: N simulated vLLM replicas on 127.0.0.1:P..P+N-1 in one process.

All replicas share one asyncio loop (uvloop when installed). Ctrl-C / SIGTERM stop them
cleanly. Defaults make a plain ``gateway sim`` useful: 2 replicas, 2048 KV blocks of 16
tokens each (32k tokens), real-time H100 timing for an 8B model (``--speed 1``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Mapping

from gateway.extras import MissingExtra
from gateway.logs import configure_logging
from gateway.sim.cluster import SimCluster, SimOptions
from gateway.sim.connector import ROLES
from gateway.sim.kvpublish import KVEventsOptions
from gateway.sim.transfer import TransferConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = SimOptions()
    a = parser.add_argument
    a("--replicas", type=int, default=d.replicas, help="number of replicas (default %(default)s)")
    a("--port", type=int, default=d.port, help="first port (default %(default)s)")
    a("--host", default=d.host, help="bind address (default %(default)s)")
    a("--model", default=d.model, help="served model name (default %(default)s)")
    a("--kv-blocks", type=int, default=d.kv_blocks,
      help="KV blocks per replica (default %(default)s)")
    a("--block-size", type=int, default=d.block_size,
      help="tokens per KV block (default %(default)s)")
    a("--max-model-len", type=int, default=d.max_model_len,
      help="as vLLM: the context length, prompt and output (default %(default)s)")
    a("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
      help="as vLLM: tokens per engine step, prefill chunks included (default %(default)s)")
    a("--max-num-seqs", type=int, default=d.max_num_seqs,
      help="as vLLM: requests running at once per replica (default %(default)s)")
    a("--scheduling-policy", choices=["fcfs", "priority"], default=d.scheduling_policy,
      help="as vLLM: priority schedules waiting requests by their `priority` (lower first)")
    a(
        "--speed",
        type=float,
        default=d.speed,
        help="simulated seconds per wall second (1 = real time, 100 = 100x faster)",
    )
    a("--seed", type=int, default=d.seed,
      help="seeds the replies' words, tool calls and step-time noise (default %(default)s)")
    a(
        "--contract",
        choices=["0.23", "0.24", "0.32"],
        default=d.contract,
        help="vLLM behaviour version (default %(default)s, the vLLM tested here; "
        "bench/results/sim-parity.md lists the differences)",
    )
    a(
        "--enable-auto-tool-choice",
        action="store_true",
        help="as vLLM: accept tool_choice 'auto' (needs --tool-call-parser)",
    )
    a("--tool-call-parser",
      help="as vLLM, with --enable-auto-tool-choice: tool_choice named, 'required' and "
      "'auto' answer tool calls as the hermes parser returns them")
    a("--tool-call-probability", type=float, default=d.tool_call_probability,
      help="tool_choice 'auto': the share of answers that are a tool call, drawn per "
      "prompt from --seed (default %(default)s)")
    a(
        "--dev-mode",
        action="store_true",
        help="as vLLM with VLLM_SERVER_DEV_MODE=1 (also honoured): serve POST /reset_prefix_cache",
    )
    a(
        "--no-prompt-tokens-details",
        action="store_true",
        help="as vLLM without --enable-prompt-tokens-details: never fill prompt_tokens_details",
    )
    a("--enable-force-include-usage", action="store_true",
      help="as vLLM: every stream ends with a usage chunk, asked for or not")
    a(
        "--timing-comments",
        action="store_true",
        help="report simulated latencies (x-sim-timing header / ': sim-timing' SSE comment)",
    )
    a("--log-interval", type=float, default=d.log_interval, help="stats log period (s)")
    a(
        "--deprecated-metrics",
        action="store_true",
        help="also export vllm:gpu_cache_usage_perc and vllm:gpu_prefix_cache_*",
    )
    a(
        "--output-len",
        type=int,
        default=d.output_len,
        help="mean completion length when max_tokens is absent",
    )
    a(
        "--responses-store",
        action="store_true",
        help="keep Responses API responses for previous_response_id, as vLLM with "
        "VLLM_ENABLE_RESPONSES_API_STORE=1 (also switched on by that variable)",
    )
    a("--log-level", choices=["debug", "info", "warning", "error"], default="info",
      help="default %(default)s")
    a("--log-format", choices=["json", "text"], default="json",
      help="json (default, one object per line, as gateway serve) or text")
    a(
        "--kv-events",
        action="store_true",
        help="publish KV-cache events over ZMQ as vLLM with --kv-events-config (needs the "
        "'kv' extra); replica i publishes on --kv-events-port + 2i, replays on the next port, "
        "and GET /kv_event_sources says so",
    )
    a("--kv-events-port", type=int, default=KVEventsOptions().port,
      help="first KV-event port (default %(default)s, vLLM's)")
    a("--kv-events-encoding", choices=["map", "array"], default="map",
      help="event encoding: map (vLLM >= 0.11, default) or array (positional, older vLLM)")
    a(
        "--hash-seed",
        choices=["fixed", "random"],
        default=d.hash_seed,
        help="NONE_HASH per replica: fixed (0.33 sha256) or random (0.11)",
    )
    add_pd_arguments(parser)


def add_pd_arguments(parser: argparse.ArgumentParser) -> None:
    t = TransferConfig()
    a = parser.add_argument
    a("--role", action="append", choices=ROLES, default=[],
      help="P/D: replica i takes the i-th --role, the last repeating (default: both, no KV "
      "connector); prefill and decode get vLLM's NixlConnector (kv_both) and answer either "
      "leg, as the router asks; P and D must run in one `gateway sim`")
    a("--kv-lease-s", type=float, default=t.lease_s,
      help="P/D: wall seconds P holds a prefill leg's KV for D (default %(default)s, "
      "vLLM's kv_lease_duration; the router's round trip is not scaled by --speed)")
    a("--kv-transfer-us-per-token", type=float, default=t.seconds_per_token * 1e6,
      help="P/D: simulated microseconds a KV pull takes per token (default %(default)s)")
    a("--bidirectional-kv-xfer", action="store_true",
      help="P/D: a decode leg's answer carries its own kv_transfer_params and keeps its KV "
      "for the next turn's prefill leg (vLLM's bidirectional_kv_xfer)")
    a("--stream-kv-params", action="store_true",
      help="P/D: a streamed chat or completions answer's final chunk carries its "
      "kv_transfer_params (vLLM 0.32 sends them only in whole answers)")
    a("--decoder-kv-ttl-s", type=float, default=t.decoder_ttl_s,
      help="P/D: simulated seconds D keeps that KV (default %(default)s, "
      "decoder_kv_blocks_ttl; a client's gap between turns scales with --speed)")
    a("--kv-recompute-threshold", type=int, default=t.recompute_threshold,
      help="P/D: P pulls a decoder's KV only when it lacks more than this many tokens "
      "(default %(default)s)")


def options_from(args: argparse.Namespace, env: Mapping[str, str]) -> SimOptions:
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        # vLLM's own start-up check.
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    return SimOptions(
        replicas=args.replicas,
        host=args.host,
        port=args.port,
        model=args.model,
        kv_blocks=args.kv_blocks,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        scheduling_policy=args.scheduling_policy,
        speed=args.speed,
        seed=args.seed,
        tool_call_probability=args.tool_call_probability,
        contract=args.contract,
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        dev_mode=args.dev_mode or env.get("VLLM_SERVER_DEV_MODE", "0") not in ("", "0"),
        prompt_tokens_details=not args.no_prompt_tokens_details,
        force_include_usage=args.enable_force_include_usage,
        timing_comments=args.timing_comments,
        log_interval=args.log_interval,
        deprecated_metrics=args.deprecated_metrics,
        output_len=args.output_len,
        hash_seed=args.hash_seed,
        kv_events=KVEventsOptions(port=args.kv_events_port, encoding=args.kv_events_encoding)
        if args.kv_events else None,
        roles=tuple(args.role),
        transfer=TransferConfig(
            lease_s=args.kv_lease_s, bidirectional=args.bidirectional_kv_xfer,
            decoder_ttl_s=args.decoder_kv_ttl_s,
            recompute_threshold=args.kv_recompute_threshold,
            stream_params=args.stream_kv_params,
            seconds_per_token=args.kv_transfer_us_per_token / 1e6),
        responses_store=args.responses_store
        or os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE", "0") not in ("", "0", "false"),
    )


async def serve(options: SimOptions) -> None:
    cluster = SimCluster(options)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await cluster.start()
    logging.getLogger("gateway.sim").info(
        "simulating %d vLLM replica(s) of %s at %s (speed %gx)",
        options.replicas,
        options.model,
        ", ".join(cluster.urls),
        options.speed,
    )
    try:
        await stop.wait()
    finally:
        await cluster.stop()


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format)
    try:
        options = options_from(args, os.environ)
    except ValueError as e:
        print(f"gateway sim: {e}", file=sys.stderr)
        return 2
    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    try:
        runner(serve(options))
    except MissingExtra as e:
        print(f"gateway sim: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"gateway sim: {e}", file=sys.stderr)
        return 1
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    return 0
