"""`python -m gateway.healthcheck [CONFIG]`: the container's health check. It reads the
port as `gateway serve` does (the TOML file when it exists, then the `GATEWAY_*`
environment) and asks `/health` on loopback: exit 0 when it answers 200, else 1. So the
check follows the configured port instead of assuming 8080; a port given only with
`--port` on the command line is invisible to it (set it in the file or the environment).
"""

from __future__ import annotations

import os
import sys
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from gateway.coerce import SettingsError
from gateway.settings import parse_settings

DEFAULT_CONFIG = "/etc/gateway/gateway.toml"


def health_url(config_text: str | None, env: Mapping[str, str]) -> str:
    server = parse_settings(config_text, env, source="healthcheck").server
    host = "[::1]" if ":" in server.host else "127.0.0.1"  # the wildcard's loopback
    return f"http://{host}:{server.port}/health"


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    path = Path(args[0] if args else DEFAULT_CONFIG)
    try:
        text = path.read_text(encoding="utf-8") if path.exists() else None
        url = health_url(text, os.environ)
    except (OSError, SettingsError) as exc:
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 1
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return 0 if resp.status == 200 else 1
    except OSError as exc:
        print(f"healthcheck: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
