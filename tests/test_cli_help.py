"""What the commands' --help says: the gateway described (not its module imports), each
listener's own default port, a help text for every `gateway sim` option, and the embedded
simulator's speed in `gateway serve`'s start-up line."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from gateway.cli import main
from gateway.serve import demo_line
from gateway.sim.cli import add_arguments as sim_arguments
from gateway.sim.cluster import SimOptions


def help_text(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    return " ".join(out.getvalue().split())  # argparse wraps lines


def test_gateway_help_describes_the_gateway() -> None:
    text = help_text()
    assert "import" not in text
    assert "caching-aware" in text and "gateway serve" in text


@pytest.mark.parametrize(("command", "port", "section"), [
    ("serve", 8080, "server"), ("epp", 9002, "epp")])
def test_each_listener_gives_its_own_default_port(command: str, port: int,
                                                  section: str) -> None:
    text = help_text(command)
    assert f"listen port ({section}.port, default {port})" in text
    other = 9002 if port == 8080 else 8080
    assert f"default {other})" not in text


def test_serve_help_names_the_demo_speed() -> None:
    assert "--demo-speed" in help_text("serve")


def test_every_sim_option_has_help() -> None:
    parser = argparse.ArgumentParser()
    sim_arguments(parser)
    bare = [a.option_strings for a in parser._actions if not a.help]
    assert bare == []


@pytest.mark.parametrize(("speed", "per_token", "long_s"), [
    (1.0, "6.3 ms", "about 227 s"), (10.0, "0.63 ms", "about 23 s"),
    (100.0, "0.063 ms", "about 2 s")])
def test_the_start_up_line_says_the_speed(speed: float, per_token: str, long_s: str) -> None:
    line = demo_line(SimOptions(replicas=4, speed=speed))
    assert f"at {speed:g}x an H100's real time" in line
    assert per_token in line and f"max_tokens 32700 takes {long_s}" in line
    assert "--demo-speed" in line
