"""gateway-bench as a new user meets it: `run` against a plain `gateway serve` (the
embedded fleet) computes its cache bound without being told where a replica is, and its
default output folder never dirties the checkout."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.bench.cli import build_parser, main
from gateway.bench.flags import SHIPPED_TRACE
from gateway.bench.server import replica_urls
from tests.servers import free_port, running, script

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def demo() -> Iterator[str]:
    """A plain `gateway serve` (the port from the environment, so runs do not collide)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running([*script("gateway"), "serve"], [url + "/ready"],
                 env={"GATEWAY_SERVER__PORT": str(port)}):
        yield url


def test_run_against_the_embedded_fleet_has_a_bound(
    demo: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    rc = main(["run", "--base-url", demo, "--preset", "tiny", "--time-scale", "0.005",
               "--sessions", "2", "--turns", "3", "--out", str(tmp_path), "--no-progress",
               "--max-wall-s", "120"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "no bound" not in out and "tool_choice" not in out, out
    summary = json.loads((tmp_path / "run.json").read_text())["summary"]
    assert "bound_error" not in summary
    assert summary["bound"]["cached_tokens"] > 0 and summary["bound"]["block_size"] == 16


def test_replay_finds_the_shipped_trace(
    demo: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    assert SHIPPED_TRACE.stat().st_size < 100_000  # a slice, well under a megabyte
    assert (SHIPPED_TRACE.parent / "LICENSE-Apache-2.0.txt").exists()
    rc = main(["replay", "--base-url", demo, "--limit", "6", "--speedup", "1000",
               "--max-tokens-cap", "2", "--out", str(tmp_path), "--no-progress",
               "--max-wall-s", "120"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "requests" in out and (tmp_path / "replay.json").exists(), out


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                          check=False)


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="not a git checkout")
@pytest.mark.parametrize("command", [["run", "--base-url", "http://127.0.0.1:1"],
                                     ["replay", "t.jsonl", "--base-url", "http://127.0.0.1:1"],
                                     ["compare"]])
def test_default_output_is_ignored_by_git(command: list[str]) -> None:
    out = build_parser().parse_args(command).out
    assert not out.is_absolute()
    for where in (ROOT / out, ROOT / "bench" / out):  # wherever in the checkout it runs
        probe = where / "logs" / "usage-prefix.jsonl"
        assert _git("check-ignore", "-q", str(probe)).returncode == 0, probe
    assert _git("ls-files", str(ROOT / out)).stdout == ""  # nothing of it committed


@pytest.mark.parametrize(("stats", "expected"), [
    ({"replicas": {"b": {"url": "http://127.0.0.1:2", "healthy": True},
                   "a": {"url": "http://127.0.0.1:1", "healthy": True}}},
     ["http://127.0.0.1:1", "http://127.0.0.1:2"]),
    ({"replicas": {"a": {"url": "http://127.0.0.1:1", "healthy": False},
                   "b": {"url": "http://127.0.0.1:2"}}}, ["http://127.0.0.1:2"]),
    ({"replicas": {"a": {"url": "file:///etc/passwd"}}}, []),
    ({"replicas": {"a": {"scraped": False}}}, []),  # a gateway too old to name them
    ({"object": "error"}, []), ([], []), ("x", []),
])  # fmt: skip
def test_replica_urls_from_stats(stats: object, expected: list[str]) -> None:
    assert replica_urls(stats) == expected
