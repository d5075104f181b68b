"""`gateway epp`'s settings: `gateway serve`'s flags, `--host`/`--port` naming the gRPC
listener, and the mistakes that stop it before it starts (exit status 2, one line)."""

from __future__ import annotations

import pytest

from gateway.cli import main
from gateway.epp.run import epp_settings
from gateway.serve import add_arguments


@pytest.mark.parametrize(("argv", "fragment"), [
    (["epp"], "no replicas"),
    (["epp", "--backend", "http://127.0.0.1:9", "--port", "70000"], "epp.port"),
    (["epp", "--backend", "http://127.0.0.1:9", "--policy", "nope"], "policy"),
])
def test_refused_before_start(argv: list[str], fragment: str,
                              capsys: pytest.CaptureFixture[str],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GATEWAY_BACKENDS", raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("gateway epp: ") and fragment in err


def test_host_and_port_are_the_grpc_listeners() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--backend", "http://10.0.0.1:8000", "--host", "0.0.0.0",
                              "--port", "9100"])
    settings = epp_settings(args, {"GATEWAY_EPP__RESPONSE": "body"})
    assert (settings.epp.host, settings.epp.port, settings.epp.response) == (
        "0.0.0.0", 9100, "body")
    assert (settings.server.host, settings.server.port) == ("127.0.0.1", 8080)  # untouched
    assert [r.url for r in settings.replicas] == ["http://10.0.0.1:8000"]
