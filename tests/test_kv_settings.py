"""`[tokens]` settings, per-replica event endpoints, `gateway sim --kv-events` options, and
`gateway serve` refusing a token-mode model it cannot load (one line, exit 2)."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

from gateway.coerce import SettingsError
from gateway.settings import parse_settings
from gateway.sim.cli import add_arguments, options_from
from gateway.sim.kvpublish import source_config
from tests.servers import script


@pytest.mark.parametrize(("toml", "env", "want"), [
    ("", {}, {}),
    ('[tokens]\nmodels = {m = "sim"}\n', {}, {"m": "sim"}),
    ("", {"GATEWAY_TOKENS__MODELS": "a=/models/a,b=sim"}, {"a": "/models/a", "b": "sim"}),
])
def test_token_models_from_file_and_environment(toml: str, env: dict[str, str],
                                                want: dict[str, str]) -> None:
    s = parse_settings(toml, env)
    assert dict(s.tokens.models) == want
    assert s.tokens.enabled is bool(want)


@pytest.mark.parametrize(("toml", "message"), [
    ("[tokens]\nblock_size = 0\n", "block_size"),
    ("[tokens]\nreplay_timeout_s = -1\n", "replay_timeout_s"),
    ('[tokens]\nmodels = {m = ""}\n', "tokens.models"),
    ('[tokens]\nmodel = {m = "sim"}\n', "model"),
    ('[[replicas]]\nname = "a"\nurl = "http://h:1"\nkv_events_endpoint = "ipc:///tmp/x"\n',
     "kv_events_endpoint must be tcp://"),
])
def test_bad_token_settings_name_the_field(toml: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        parse_settings(toml, {})


def test_replica_event_endpoints_are_kept() -> None:
    s = parse_settings('[[replicas]]\nname = "a"\nurl = "http://h:1"\n'
                       'kv_events_endpoint = "tcp://h:5557"\n'
                       'kv_events_replay_endpoint = "tcp://h:5558"\n', {})
    assert (s.replicas[0].kv_events_endpoint, s.replicas[0].kv_events_replay_endpoint) == (
        "tcp://h:5557", "tcp://h:5558")


@pytest.mark.parametrize(("argv", "want"), [
    ([], None),
    (["--kv-events"], (5557, "map")),
    (["--kv-events", "--kv-events-port", "7000", "--kv-events-encoding", "array"],
     (7000, "array")),
])
def test_sim_kv_event_flags(argv: list[str], want: tuple[int, str] | None) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    options = options_from(parser.parse_args(argv), {})
    got = options.kv_events
    assert (got.port, got.encoding) == want if got is not None else want is None


def test_sim_sources_answer_like_vllm() -> None:
    got = source_config("0.0.0.0", 7000, 7001, 10)["0"]
    assert (got["endpoint"], got["replay_endpoint"], got["topic"]) == (
        "tcp://*:7000", "tcp://*:7001", "kv")
    assert got["enable_kv_cache_events"] is True and got["publisher"] == "zmq"


def test_serve_refuses_a_model_directory_without_a_tokenizer(tmp_path: Path) -> None:
    done = subprocess.run(
        [*script("gateway"), "serve", "--backend", "http://127.0.0.1:9"],
        env={"PATH": "/usr/bin:/bin", "GATEWAY_TOKENS__MODELS": f"m={tmp_path}"},
        capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"gateway serve: tokens.models['m']: no tokenizer.json in {tmp_path}"]


def test_the_simulator_renderer_comes_from_serve() -> None:
    """`gateway.proxy` never imports the simulator: `serve.py` hands its renderer in."""
    from gateway.events.config import TokenSettings
    from gateway.proxy.tokenmode import TokenModelError, load_renderers
    from gateway.serve import sim_renderer

    settings = TokenSettings(models={"sim": "sim"}, block_size=32)
    with pytest.raises(TokenModelError, match="renderer was not supplied"):
        load_renderers(settings)
    renderer = load_renderers(settings, sim_renderer)["sim"]
    assert renderer.block_size == 32
