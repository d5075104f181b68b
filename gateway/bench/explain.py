"""What the benchmark's output means, printed beside it: one line per column label (the
policy and how its sessions were named), what the paced columns are, and what each check
measures, so that a reader does not need the README to read a table.

Pure: labels and checks in, lines out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

POLICIES: dict[str, str] = {
    "prefix": "the gateway's default: each request to the replica with the lowest "
              "estimated time to first token (its cached prefix against the queue there)",
    "round_robin": "each request to the next replica in turn; the cache is ignored",
    "least_loaded": "each request to the replica with the fewest requests in flight; the "
                    "cache is ignored",
    "session": "a hash of the session id: a session always goes to the same replica",
    "random": "each request to a replica drawn at random",
}
NAMING: dict[str, str] = {
    "header": "sessions named in an x-session-id header",
    "prompt_cache_key": "sessions named in the body's prompt_cache_key",
    "user": "sessions named in the body's user field",
    "none": "no session id sent, as most applications do: conversations are recognised "
            "from their prompts",
}
QUEUE_NOTE = "with the gateway's admission queue on"

PACING = ("req/s and prompt tokens/s (paced) are the benchmark's own pacing: sessions, "
          "think time and the concurrency cap set them, not what the fleet could serve; a "
          "column whose answers come later finishes later and reads lower. Compare "
          "capacity with a load test, not with these rows.")

CHECKS: dict[str, str] = {
    "cached ratio vs bound": "the prefix column's cached tokens as a share of the most any "
                             "router could have had cached with these caches",
    "request imbalance max/mean": "requests on the busiest replica over the mean: how "
                                  "evenly the prefix column spread the load",
    "TTFT p99 vs least_loaded": "the prefix column's p99 time to first token against the "
                                "load balancer's (caching must not cost the slowest "
                                "requests)",
    "predicted vs delivered median abs error": "how far the router's predicted cached "
                                               "tokens were from what the engine reported",
    "follow-up turns moved": "the share of a conversation's later turns sent to another "
                             "replica than its previous turn (each re-prefills its history "
                             "there)",
    "TTFT p99 vs session (named sessions)": "the column's p99 time to first token against "
                                            "sticky sessions by hash",
}
NOT_MET = ("[NOT MET]: the prefix column missed a target the project sets for its routing "
           "on this preset; the figures are still valid and the run succeeded (exit status "
           "0). bench/RESULTS.md has the targets' history.")


PD_NOTE = ("on a prefill/decode fleet (--pd P:D: the first P simulated replicas prefill, "
           "the rest decode; the gateway's P/D legs)")


def column(label: str, default_naming: str) -> str:
    """One line saying what a column (`prefix`, `prefix@none`, `prefix+queue`,
    `prefix+pd`) ran."""
    name, _, how = label.partition("@")
    policy, *flags = name.split("+")
    queued = "queue" in flags
    what = POLICIES.get(policy, "a routing policy of the gateway")
    naming = NAMING.get(how or default_naming, "")
    parts = [what]
    if policy in ("prefix", "session") and naming:
        parts.append(naming)
    if queued:
        parts.append(QUEUE_NOTE)
    if "pd" in flags:
        parts.append(PD_NOTE)
    return f"  {label}: " + "; ".join(parts)


def legend(labels: Iterable[str], default_naming: str) -> list[str]:
    return ["columns:", *(column(label, default_naming) for label in labels)]


def meaning(check: str) -> str:
    """What a check measures (`prefix@none: follow-up turns moved` -> the part after the
    column's name)."""
    name = check.split(": ", 1)[-1]
    return CHECKS.get(name, "")


def needs_not_met_note(checks: Iterable[Mapping[str, Any]]) -> bool:
    return any(c.get("met") is False for c in checks)
