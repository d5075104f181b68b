"""`gateway serve` in front of llama.cpp replicas, configured by a TOML file.

llama.cpp reports no `vllm:cache_config_info`, so the gateway cannot learn a replica's KV
capacity; the file gives it per replica (`[[replicas]] capacity_tokens`), which is how an
operator runs the gateway against such engines. `gateway_toml()` renders that file;
`fronted()` writes it to a temporary folder and runs the gateway (via `tests.servers`).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from tests.servers import gateway


def gateway_toml(
    urls: Sequence[str], *, policy: str, capacity_tokens: int | None, extra: str = ""
) -> str:
    lines = ["[routing]", f"policy = {json.dumps(policy)}", ""]
    for i, url in enumerate(urls):
        lines += ["[[replicas]]", f'name = "llama-{i}"', f"url = {json.dumps(url)}"]
        if capacity_tokens is not None:
            lines.append(f"capacity_tokens = {capacity_tokens}")
        lines.append("")
    return "\n".join(lines) + extra


@contextlib.contextmanager
def fronted(
    urls: Sequence[str],
    *,
    policy: str = "prefix",
    capacity_tokens: int | None = None,
    extra_toml: str = "",
    extra_args: Sequence[str] = (),
) -> Iterator[str]:
    """Gateway base URL (no /v1) in front of `urls`, replicas named llama-0, llama-1, ..."""
    with tempfile.TemporaryDirectory(prefix="gw-realengine-") as folder:
        path = Path(folder) / "gateway.toml"
        path.write_text(gateway_toml(urls, policy=policy, capacity_tokens=capacity_tokens,
                                     extra=extra_toml))  # fmt: skip
        with gateway([], ["--config", str(path), *extra_args]) as url:
            yield url
