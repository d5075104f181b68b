"""The `gateway` command: one subcommand per module, imported only when used so that
`gateway lint` does not pay for the server stack and `gateway --help` stays instant."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from gateway import __version__

# name -> (module exposing add_arguments(parser) and run(args) -> int, help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("gateway.serve", "run the gateway in front of vLLM replicas (or the simulator)"),
    "epp": ("gateway.epp.run", "pick endpoints for Envoy (Gateway API Inference Extension, "
            "ext_proc gRPC)"),
    "sim": ("gateway.sim.cli", "run simulated vLLM replicas on 127.0.0.1"),
    "lint": ("gateway.hygiene.lint", "find prefix-breaking content in logged request bodies"),
    "report": ("gateway.usage.report", "summarise a usage log"),
}


DESCRIPTION = """A caching-aware OpenAI-compatible gateway in front of vLLM replicas: it sends each
request to the replica most likely to hold its prompt prefix in KV cache, finds what breaks
those prefixes, and records cached tokens per request. `gateway serve` alone starts a
demo (an embedded simulator); `gateway COMMAND --help` describes each command."""

DESCRIPTIONS = {
    "serve": """Run the gateway: an OpenAI-compatible proxy in front of vLLM replicas that routes
each request to the replica most likely to hold its prompt prefix in KV cache.

Replicas come from --backend URL (repeatable), [[replicas]] in --config FILE, or
GATEWAY_BACKENDS=url1,url2. With none at all, an embedded simulator (4 simulated vLLM
replicas on free loopback ports) is started and fronted, so `gateway serve` alone is a
working demo.

Every setting can also be given as an environment variable, GATEWAY_<SECTION>__<KEY>
(e.g. GATEWAY_ROUTING__POLICY=session, GATEWAY_SERVER__LOG_LEVEL=debug,
GATEWAY_AUTH__KEYS=sk-a=team-a); later wins: file, environment, flags. See
config/gateway.example.toml for every setting.

Logs: one JSON object per line on stderr (--log-format text for a terminal), an access
line per request, level --log-level. Endpoints: /v1/* (proxied), /health, /ready,
/metrics (Prometheus), /stats (JSON; /stats?format=html for a page).""",
    "epp": """Run the gateway's router as a Kubernetes endpoint picker: an Envoy ext_proc gRPC
service (Gateway API Inference Extension protocol) that reads each request, picks the
replica most likely to hold its prompt prefix, and names it to Envoy in
x-gateway-destination-endpoint. Same settings file, routing, hygiene and usage records as
`gateway serve`; --host/--port are the gRPC listener's (default 127.0.0.1:9002).
Needs the `epp` extra: pip install 'cache-gateway[epp]'.""",
    "sim": """Run N simulated vLLM replicas (vLLM 0.32's HTTP contract, prefix cache, scheduler
and timing model) on 127.0.0.1:PORT..PORT+N-1, with no GPU and no model download.""",
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gateway", description=DESCRIPTION)
    version = f"gateway {__version__}"
    parser.add_argument("--version", action="version", version=version)
    sub = parser.add_subparsers(dest="command", required=True)
    args_list = list(sys.argv[1:] if argv is None else argv)
    chosen = args_list[0] if args_list and args_list[0] in SUBCOMMANDS else None
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=DESCRIPTIONS.get(name, help_text),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--version", action="version", version=version)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            modules[name] = module
    args = parser.parse_args(args_list)
    return int(modules[args.command].run(args))


if __name__ == "__main__":
    sys.exit(main())
