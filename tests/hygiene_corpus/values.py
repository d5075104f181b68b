"""Value families: timestamp, uuid, request_id, nonce, counter. Per case index: a single
request whose value is plainly per-request (pattern evidence), a session where only the value
changes (drift; some sessionless, judged by template), the same in a tool description, an
early user message and a completions prompt; negatives: the value held fixed across the
session, volatile values only in the last message or in replayed assistant output."""

from __future__ import annotations

import random
from datetime import UTC, datetime

from tests.hygiene_corpus.common import (
    FORMATS,
    NOW,
    QUESTIONS,
    Case,
    Req,
    _b62,
    _hex,
    _rules,
    _session_case,
    _single,
    _timestamp,
    _tools,
    _turns,
    _uuid,
    chat,
    embed,
)

PER_REQUEST_UUID_LABELS = [
    "Request ID",
    "trace_id",
    "Correlation ID",
    "Idempotency key",
    "Message ID",
]
PER_REQUEST_ID = [
    ("Request ID", lambda r: _hex(r, 24)),
    ("request_id", lambda r: "req_" + _b62(r, 24)),
    ("Trace", lambda r: "trace-" + _hex(r, 16)),
    ("span_id", lambda r: _hex(r, 16)),
    ("Completion", lambda r: "chatcmpl-" + _b62(r, 29)),
    ("Event", lambda r: "evt_" + _b62(r, 20)),
]
DRIFT_ID = [
    ("Run", lambda r: "run_" + _hex(r, 12)),
    ("Job", lambda r: "job-" + _b62(r, 10)),
    ("Instance", lambda r: _hex(r, 32)),
]
NONCE_LABELS = ["nonce", "csrf_token", "salt", "cache_buster", "random_string"]
COUNTERS = [
    lambda n: f"This is turn {n} of 20",
    lambda n: f"Request #{n}",
    lambda n: f"Attempt {n} of 5",
    lambda n: f"message {n + 11}",
    lambda n: f"Iteration {n}",
    lambda n: f"round {n}/10",
]


def value_cases(rng: random.Random, per: int) -> list[Case]:
    cases: list[Case] = []
    for i in range(per):
        fmt = FORMATS[i % len(FORMATS)]
        # timestamp: one request (pattern) or a session where it ticks (drift)
        label, value = _timestamp(rng, NOW + rng.uniform(-30, 30))
        cases.append(
            _single(f"ts-single-{i}", "timestamp", embed(fmt, label, value, rng), rng, "timestamp")
        )
        fmt_seed = rng.random()

        def ts_sys(k: int, fmt: str = fmt, seed: float = fmt_seed, i: int = i) -> str:
            r = random.Random(seed)
            lab, _ = _timestamp(random.Random(seed), NOW)
            _, val = _timestamp(
                random.Random(seed), NOW + 61 * k + (86400 * k if i % 7 == 0 else 0)
            )
            return embed(fmt, lab, val, r)

        cases.append(
            _session_case(
                f"ts-drift-{i}", "timestamp", ts_sys, rng, "timestamp", sessionless=i % 3 == 0
            )
        )
        # uuid
        lab = PER_REQUEST_UUID_LABELS[i % len(PER_REQUEST_UUID_LABELS)]
        cases.append(
            _single(f"uuid-single-{i}", "uuid", embed(fmt, lab, _uuid(rng), rng), rng, "uuid")
        )
        seed = rng.random()
        cases.append(
            _session_case(
                f"uuid-drift-{i}",
                "uuid",
                lambda k, fmt=fmt, seed=seed: embed(
                    fmt, "Instance", _uuid(random.Random(seed + k)), random.Random(seed)
                ),
                rng,
                "uuid",
                sessionless=i % 3 == 1,
            )
        )
        # request / session / trace ids
        lab, gen = PER_REQUEST_ID[i % len(PER_REQUEST_ID)]
        cases.append(
            _single(
                f"rid-single-{i}", "request_id", embed(fmt, lab, gen(rng), rng), rng, "request_id"
            )
        )
        lab, gen = DRIFT_ID[i % len(DRIFT_ID)]
        seed = rng.random()
        cases.append(
            _session_case(
                f"rid-drift-{i}",
                "request_id",
                lambda k, fmt=fmt, seed=seed, lab=lab, gen=gen: embed(
                    fmt, lab, gen(random.Random(seed + k)), random.Random(seed)
                ),
                rng,
                "request_id",
            )
        )
        # nonces and random tokens
        lab = NONCE_LABELS[i % len(NONCE_LABELS)]
        cases.append(
            _single(
                f"nonce-single-{i}",
                "nonce",
                embed(fmt, lab, _b62(rng, 16 + i % 16), rng),
                rng,
                "nonce",
            )
        )
        seed = rng.random()
        cases.append(
            _session_case(
                f"nonce-drift-{i}",
                "nonce",
                lambda k, fmt=fmt, seed=seed, i=i: embed(
                    fmt,
                    "Instance token",
                    _b62(random.Random(seed + k), 20 + i % 12),
                    random.Random(seed),
                ),
                rng,
                "nonce",
                sessionless=i % 4 == 0,
            )
        )
        # counters
        counter = COUNTERS[i % len(COUNTERS)]
        start = rng.randint(1, 9)
        seed = rng.random()
        cases.append(
            _session_case(
                f"counter-drift-{i}",
                "counter",
                lambda k, fmt=fmt, seed=seed, counter=counter, start=start: embed(
                    fmt, "Progress", counter(start + k), random.Random(seed)
                ),
                rng,
                "counter",
            )
        )
        cases.append(
            _single(
                f"counter-single-{i}",
                "counter",
                embed(fmt, "Progress", counter(start), rng),
                rng,
                "counter",
            )
        )
        cases.extend(_placement_cases(rng, i))
        cases.extend(_value_negatives(rng, i, fmt))
    return cases


def _placement_cases(rng: random.Random, i: int) -> list[Case]:
    """Volatile values outside the system prompt: in a tool description, in an early user
    message the client regenerates on every request, in a completions prompt."""
    out: list[Case] = []
    label, value = _timestamp(rng, NOW + rng.uniform(-30, 30))
    tools = _tools(rng, 4)
    tools[0]["function"]["description"] += f" Index refreshed {label.lower()} {value}."
    out.append(
        Case(
            f"ts-tools-{i}",
            "timestamp",
            (Req(chat(_rules(rng), _turns(rng, 3), tools), None, NOW),),
            "timestamp",
            (None, "tools"),
        )
    )
    sys_text = "You are a coding agent. " + _rules(rng)
    seed = rng.random()
    reqs = []
    for k in range(3):
        _, v = _timestamp(random.Random(seed), NOW + 61 * k)
        ctx = (
            f"<env>\ncwd: /home/dev/project\nclock: {v}\nbranch: main\n</env>\n"
            + QUESTIONS[i % len(QUESTIONS)]
        )
        turns = [ctx, *_turns(random.Random(seed), 2 * k + 2)[1:]]
        reqs.append(
            Req(chat(sys_text, turns[: 2 * k + 1] if k else turns[:1]), f"agent-{i}", NOW + 11 * k)
        )
    # the context message is the last one in the first request: only later ones can judge it
    out.append(Case(f"ts-early-user-{i}", "timestamp", tuple(reqs), "timestamp", (1, "user")))
    prompt = (
        f"### Request id: req_{_b62(rng, 20)}\n" + _rules(rng) + "\nQ: " + QUESTIONS[i % 5] + "\nA:"
    )
    out.append(
        Case(
            f"rid-completions-{i}",
            "request_id",
            (Req({"model": "m", "prompt": prompt}, None, NOW, "completions"),),
            "request_id",
            (None, "prompt"),
        )
    )
    return out


def _value_negatives(rng: random.Random, i: int, fmt: str) -> list[Case]:
    out: list[Case] = []
    seed = rng.random()
    fixed = [
        ("Knowledge cutoff", "2023-10-01"),
        ("Policy last updated", "2023-03-14T09:00:00Z"),
        ("Today", datetime.fromtimestamp(NOW, UTC).strftime("%Y-%m-%d")),
        ("Today is", f"{datetime.fromtimestamp(NOW, UTC):%B} 1, 2024"),
        ("Tenant", _uuid(random.Random(seed))),
        ("Session ID", "sess_" + _b62(random.Random(seed), 16)),
        ("Account", "acct_" + _b62(random.Random(seed), 14)),
        ("Public key", _b62(random.Random(seed), 24)),
        ("Build", _hex(random.Random(seed), 40)),
        ("Progress", "Step 2 of 5"),
    ]
    label, value = fixed[i % len(fixed)]
    # fixed across a session: not a problem, whatever it looks like
    out.append(
        _session_case(
            f"neg-fixed-{i}",
            "negative",
            lambda k: embed(fmt, label, value, random.Random(seed)),
            rng,
            None,
            sessionless=i % 2 == 0,
        )
    )
    # volatile values only in the last user message
    _, ts = _timestamp(rng, NOW)
    last = rng.choice(
        [
            f"It is {ts} now. ",
            f"request id: req_{_b62(rng, 20)}. ",
            f"nonce={_b62(rng, 18)} ",
            f"This is attempt {i + 2}. ",
            f"trace {_uuid(rng)} ",
        ]
    )
    turns = _turns(rng, 3)
    turns[-1] = last + turns[-1]
    out.append(
        Case(
            f"neg-last-{i}",
            "negative",
            (Req(chat(embed(fmt, "Region", "eu-west", rng), turns), f"n-{i}", NOW),),
            None,
        )
    )
    # volatile values in replayed assistant output (stable history), session growing
    sysp = embed(fmt, "Region", "eu-west", rng)
    answer = f"Done. Deployed at {ts} with request id req_{_b62(rng, 16)} (attempt 2). " * 2
    base = [*_turns(rng, 1), answer, *_turns(rng, 4)]
    reqs = tuple(Req(chat(sysp, base[: 2 * k + 1]), f"h-{i}", NOW + 5 * k) for k in range(1, 3))
    out.append(Case(f"neg-history-{i}", "negative", reqs, None))
    return out
