"""P/D's settings and roles: `[[replicas]] role`, `[pd]` (GATEWAY_PD__* too),
`gateway serve --prefill URL --decode URL` beside `--backend`, and the fleet's view of
roles (a prefill replica is never a candidate for a whole request)."""

from __future__ import annotations

import argparse
import time

import pytest

from gateway.coerce import SettingsError
from gateway.pd.config import PdConfig
from gateway.replicas.fleet import Fleet
from gateway.serve import add_arguments, load_settings
from gateway.settings import ReplicaSettings, parse_settings


def test_roles_and_pd_section_from_file_and_environment() -> None:
    toml = ("[[replicas]]\nname = 'p'\nurl = 'http://h1:8000'\nrole = 'prefill'\n"
            "[[replicas]]\nname = 'd'\nurl = 'http://h2:8000'\nrole = 'decode'\n"
            "[[replicas]]\nname = 'b'\nurl = 'http://h3:8000'\n"
            "[pd]\nmin_remote_prefill_tokens = 512\nreuse_decoder_kv = true\n")
    s = parse_settings(toml, {"GATEWAY_PD__REUSE_TTL_S": "300"})
    assert [(r.name, r.role) for r in s.replicas] == [
        ("p", "prefill"), ("d", "decode"), ("b", "both")]
    assert s.pd == PdConfig(min_remote_prefill_tokens=512, reuse_decoder_kv=True,
                            reuse_ttl_s=300.0)
    assert parse_settings(None, {}).pd == PdConfig()


@pytest.mark.parametrize(("toml", "env", "needle"), [
    ("[[replicas]]\nname = 'p'\nurl = 'http://h1:8000'\nrole = 'prefil'\n", {}, "role"),
    ("[pd]\nreuse_ttl_s = 600\n", {}, "below the engine"),
    ("", {"GATEWAY_PD__MIN_REMOTE_PREFILL_TOKENS": "many"}, "min_remote_prefill_tokens"),
    ("[pd]\nreuse = true\n", {}, "reuse"),
])
def test_bad_pd_settings_name_the_key(toml: str, env: dict[str, str], needle: str) -> None:
    with pytest.raises(SettingsError, match=needle):
        parse_settings(toml, env)


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_prefill_and_decode_flags_beside_backend() -> None:
    args = _args(["--backend", "http://h1:1", "--prefill", "http://h2:2/v1",
                  "--prefill", "http://h3:3", "--decode", "http://h4:4/"])
    s = load_settings(args, {"GATEWAY_BACKENDS": "http://env:9"})
    assert [(r.name, r.role) for r in s.replicas] == [
        ("h1:1", "both"), ("h2:2", "prefill"), ("h3:3", "prefill"), ("h4:4", "decode")]
    # --prefill/--decode alone replace GATEWAY_BACKENDS too, as --backend does
    alone = load_settings(_args(["--prefill", "http://h2:2", "--decode", "http://h4:4"]),
                          {"GATEWAY_BACKENDS": "http://env:9"})
    assert [r.name for r in alone.replicas] == ["h2:2", "h4:4"]
    with pytest.raises(SettingsError, match="--prefill"):
        load_settings(_args(["--prefill", "nothing"]), {})


def _fleet(*roles: tuple[str, str]) -> Fleet:
    fleet = Fleet([ReplicaSettings(name=n, url=f"http://{n}:1", role=role,  # type: ignore[arg-type]
                                   models=("m",)) for n, role in roles])
    for n, _ in roles:
        fleet.probe_result(n, True, time.time())
    return fleet


def test_a_prefill_replica_is_never_a_candidate_for_a_whole_request() -> None:
    fleet = _fleet(("p1", "prefill"), ("d1", "decode"), ("b1", "both"), ("p2", "prefill"))
    assert [r.name for r in fleet.candidates("m")] == ["d1", "b1"]
    assert [r.name for r in fleet.serving()] == ["d1", "b1"]
    assert [r.name for r in fleet.prefill_candidates("m")] == ["p1", "p2"]
    assert fleet.prefill_candidates("other") == []
    assert fleet.has_prefill()
    fleet.probe_result("p2", False, time.time())
    assert [r.name for r in fleet.prefill_candidates("m")] == ["p1"]


def test_without_a_prefill_replica_nothing_changes() -> None:
    fleet = _fleet(("a", "both"), ("b", "both"))
    assert not fleet.has_prefill()
    assert [r.name for r in fleet.candidates("m")] == ["a", "b"] == [
        r.name for r in fleet.serving()]
    assert fleet.prefill_candidates("m") == []
