"""What the gateway keeps to itself: keys compared without timing leaks, and neither keys
nor prompt content in its logs or usage records unless the operator asks for it.

The log test runs `gateway serve` at log level `debug` (the most it ever writes) in front
of `gateway sim` and a replica that is down, with client keys and upstream keys set, and
sends requests whose prompts carry markers (inference, streaming, a hygiene finding, a bad
key, invalid JSON, an unknown model); then no marker and no key is anywhere in the
process's output or the usage log. A second run with `[hygiene] redact = false` shows the
finding's text in the log, so the test does see prompt content when it is logged."""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.proxy import auth as auth_module
from gateway.proxy.auth import Authenticator
from gateway.proxy.errors import GatewayError
from tests.servers import free_port, running, script, sim

KEYS = {"sk-alpha-0123456789": "alpha", "sk-b": "beta", "sk-a-much-longer-key-" + "x" * 80: "c"}


@pytest.mark.parametrize(("header", "tenant"), [
    (b"Bearer sk-alpha-0123456789", "alpha"),
    (b"bearer sk-b", "beta"),
    (b"Bearer  sk-b ", "beta"),
    (b"Bearer sk-alpha-012345678", None),  # a prefix of a key
    (b"Bearer sk-alpha-01234567890", None),  # a key plus one
    (b"Bearer sk-", None),
    (b"Bearer ", None),
    (b"Basic sk-b", None),
    (b"sk-b", None),
    (None, None),
    (b"Bearer \xff\x00", None),
])
def test_keys_match_exactly(header: bytes | None, tenant: str | None) -> None:
    auth = Authenticator(KEYS)
    if tenant is None:
        with pytest.raises(GatewayError) as info:
            auth.tenant(header)
        assert info.value.status == 401
    else:
        assert auth.tenant(header) == tenant


@pytest.mark.parametrize("header", [b"Bearer sk-b", b"Bearer sk-alpha-0123456789",
                                    b"Bearer wrong", b"Bearer " + b"z" * 500, None])
def test_every_key_is_compared_as_a_fixed_length_digest(
    monkeypatch: pytest.MonkeyPatch, header: bytes | None
) -> None:
    """The same comparisons, of the same lengths, whatever was presented and whichever key
    matched: timing tells neither which key nor how long one is."""
    seen: list[tuple[int, int]] = []
    real = auth_module.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth_module.hmac, "compare_digest", spy)
    auth = Authenticator(KEYS)
    with contextlib.suppress(GatewayError):
        auth.tenant(header)
    assert seen == [(32, 32)] * len(KEYS)


def test_the_keys_themselves_are_not_kept() -> None:
    auth = Authenticator(KEYS)
    kept = repr(vars(auth)) if hasattr(auth, "__dict__") else repr(auth._keys)
    assert not any(key in kept for key in KEYS)


UPSTREAM_KEY = "sk-upstream-SECRET-4c1d"
CLIENT_KEY = "sk-client-SECRET-9e2b"
WRONG_KEY = "sk-wrong-SECRET-77aa"
PROMPT = "PROMPTMARKER-5b8e"
# Derived from the clock: a timestamp counts as "the current time" only near now, so a
# literal date would age out of the finding this test relies on.
WHEN = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
SECRETS = [UPSTREAM_KEY, CLIENT_KEY, WRONG_KEY, PROMPT]


@contextlib.contextmanager
def gateway(tmp: Path, replica: str, env: dict[str, str]) -> Iterator[tuple[str, Path, Path]]:
    dead = free_port()  # nothing listens there: health probes fail, and are logged
    config = tmp / "gateway.toml"
    config.write_text(f"""
[server]
log_level = "debug"
health_interval_s = 0.2

[[replicas]]
name = "live"
url = "{replica}"
api_key = "{UPSTREAM_KEY}"

[[replicas]]
name = "dead"
url = "http://127.0.0.1:{dead}"
api_key = "{UPSTREAM_KEY}"

[auth]
keys = {{ "{CLIENT_KEY}" = "team-a" }}

[usage]
log_path = "{tmp / 'usage.jsonl'}"
startup_probe = false
""")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp / "gateway.log"
    argv = [*script("gateway"), "serve", "--config", str(config), "--port", str(port)]
    with running(argv, [url + "/health"], env=env, log_path=log):
        yield url, log, tmp / "usage.jsonl"


def traffic(url: str) -> None:
    good = {"authorization": f"Bearer {CLIENT_KEY}"}
    system = f"You are the assistant of {PROMPT}. The current time is {WHEN}. " + "Be brief. " * 40
    body = {"model": "Qwen/Qwen2.5-7B-Instruct", "max_tokens": 4, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": f"hi {PROMPT}"}]}
    with httpx.Client(timeout=30) as c:
        for stream in (False, True, False):
            r = c.post(url + "/v1/chat/completions", json={**body, "stream": stream},
                       headers={**good, "x-session-id": "s1"})
            assert r.status_code == 200, r.text
        assert c.post(url + "/v1/completions", headers=good, json={
            "model": body["model"], "prompt": f"{PROMPT} once", "max_tokens": 2}
        ).status_code == 200
        assert c.post(url + "/v1/chat/completions", json=body,
                      headers={"authorization": f"Bearer {WRONG_KEY}"}).status_code == 401
        assert c.post(url + "/v1/chat/completions", headers=good,
                      content=f'{{"model": "x", "messages": "{PROMPT}'.encode()
                      ).status_code == 400
        unknown = c.post(url + "/v1/chat/completions", headers=good,
                         json={**body, "model": "no-such-model-" + "m" * 20_000})
        assert unknown.status_code == 404
        assert c.get(url + "/stats", headers=good).status_code == 200
        assert c.get(url + "/metrics", headers=good).status_code == 200


def test_keys_and_prompts_never_reach_the_logs(tmp_path: Path) -> None:
    with sim(1, ["--speed", "1000"]) as (replica,), gateway(tmp_path, replica, {}) as (
        url, log, usage
    ):
        traffic(url)
    text = log.read_text(errors="replace")
    records = usage.read_text()
    assert "hygiene finding" in text  # it did log about these requests
    assert records.count("\n") >= 7
    # a client-chosen model name is quoted in the error, a bounded part of it
    assert max(len(line) for line in records.splitlines()) < 2000
    for secret in SECRETS:
        assert secret not in text, f"{secret} in the gateway's log"
        assert secret not in records, f"{secret} in the usage records"
    assert WHEN not in text  # a finding's span is redacted by default


def test_prompt_text_is_logged_only_when_configured(tmp_path: Path) -> None:
    with sim(1, ["--speed", "1000"]) as (replica,), gateway(
        tmp_path, replica, {"GATEWAY_HYGIENE__REDACT": "false"}
    ) as (url, log, _):
        traffic(url)
    text = log.read_text(errors="replace")
    assert WHEN in text  # the operator asked for the findings' text
    assert UPSTREAM_KEY not in text and CLIENT_KEY not in text and WRONG_KEY not in text
