"""Hand-written tricky negatives: commit hashes in code, version numbers, phone numbers,
prices, base64 in examples, dates in historical prose, fixed ids, colours, addresses."""

from __future__ import annotations

import random

from tests.hygiene_corpus.common import (
    NOW,
    Case,
    Req,
    _rules,
    _turns,
    chat,
)

TRICKY_SYSTEMS = [
    "You review code. Example:\n```\ncommit 9fceb02d0ae598e95dc970b74767f19372d61af8\nAuthor: Dev <dev@example.com>\n```\nExplain diffs.",  # noqa: E501
    "Pin versions: numpy==1.26.4, torch 2.3.1, Python 3.11.7, CUDA 12.4, node v20.11.1.",
    "Support line: +1 (555) 010-2030 or 0800 123 4567. Fax 555-123-4567.",
    "Prices: Basic $9.99/month, Pro $19.99/month, Team EUR 49.00 per seat; VAT 20%.",
    "Example image payload: data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg== .",  # noqa: E501
    "History tutor. On July 20, 1969 at 20:17 UTC Apollo 11 landed; on June 6, 1944 at 06:30 the landings began.",  # noqa: E501
    "The Treaty of Versailles was signed on 28 June 1919. The Berlin Wall fell on 9 November 1989.",
    "Office hours are 09:00-17:30 Monday to Friday; the lunch break is 12:30.",
    "Numbered procedure: Step 1: back up. Step 2: migrate. Step 3: verify. Rule 4 overrides rule 2.",  # noqa: E501
    "sha256 of the release: 3a7bd3e2360a3d29eea436fcfb7e44c735d117c42d1c1835420b6b9942dd4f1c",
    "API example: curl -H 'Authorization: Bearer sk-EXAMPLE' https://api.example.com/v1/items?page=2&limit=50",
    "Use the constant MAX_RETRIES = 3 and TIMEOUT_SECONDS = 30; HTTP 404 means not found, 503 retry later.",  # noqa: E501
    "Coordinates: 48.8584 N, 2.2945 E; elevation 330 m; population 2,102,650 (2023).",
    "Identifiers like getUserById2, parseHTTPResponse404Handler and base64Encoder are function names.",  # noqa: E501
    "The answer to question 3 in chapter 12 is on page 245. ISBN 978-3-16-148410-0.",
    "Our tenant is 123e4567-e89b-12d3-a456-426614174000 and the workspace is ws_prod_eu.",
    "Knowledge cutoff: 2023-12. Today Date: 01 Jun 2024. Cutting Knowledge Date: December 2023.",
    "Release 2024.05.2 shipped; see CHANGELOG entry 2024-05-20.",
    "IPv4 192.168.10.254, IPv6 fe80::1ff:fe23:4567:890a, MAC 00:1A:2B:3C:4D:5E.",
    "Color palette: #1A2B3C, #FFAA00, rgb(12, 34, 56). Font sizes 12/14/16 px.",
]


def tricky_cases() -> list[Case]:
    out = []
    for i, s in enumerate(TRICKY_SYSTEMS):
        rng = random.Random(1000 + i)
        system = s + " " + _rules(rng)
        turns = _turns(rng, 5)
        reqs = tuple(
            Req(chat(system, turns[: 2 * k + 1]), f"tricky-{i}" if i % 2 else None, NOW + 5 * k)
            for k in range(3)
        )
        out.append(Case(f"tricky-{i}", "negative", reqs, None))
    return out
