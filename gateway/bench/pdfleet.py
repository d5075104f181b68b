"""`gateway-bench compare --pd P:D`: a column on a prefill/decode fleet of simulated
replicas, beside the aggregated columns, at the same load (the same workload, sessions at
once and pacing).

A `+pd` column (`prefix+pd`; `--pd` adds it when no column names it) runs one `gateway
sim` with P replicas of role `prefill` then D of role `decode` (one process: the
simulated NIXL side channel is in-process), and the gateway in front of them with
`--prefill URL` and `--decode URL`. `--pd-reuse` also runs the simulator with
`--bidirectional-kv-xfer` and the gateway with `[pd] reuse_decoder_kv` (turn two pulled
back from D); its TTL, wall seconds in the gateway, is scaled with the workload's time
as the admission queue's waits are (the simulator's decoder TTL is simulated time).
"""

from __future__ import annotations

from gateway.pd.config import PdConfig

PD = "pd"  # the column flag: `prefix+pd`


def parse_pd(text: str) -> tuple[int, int]:
    """`P:D` -> (P, D), each at least 1."""
    p, sep, d = text.partition(":")
    try:
        counts = (int(p), int(d))
    except ValueError:
        counts = (0, 0)
    if not sep or min(counts) < 1:
        raise ValueError(f"--pd wants PREFILL:DECODE replica counts, each >= 1 (got {text!r})")
    return counts


def pd_default_column(columns: tuple[str, ...]) -> str:
    """The column `--pd` adds: prefix on the P/D fleet, its sessions named as the first
    prefix column names them (`prefix@none` -> `prefix+pd@none`), so the two compare."""
    first = next((c for c in columns if c.partition("@")[0] == "prefix"), "prefix")
    _, at, how = first.partition("@")
    return f"prefix+{PD}{at}{how}"


def sim_flags(pd: tuple[int, int], reuse: bool) -> list[str]:
    """`gateway sim` flags for the fleet: the roles in order, P first."""
    roles = ["prefill"] * pd[0] + ["decode"] * pd[1]
    flags = [a for role in roles for a in ("--role", role)]
    return [*flags, "--bidirectional-kv-xfer"] if reuse else flags


def fleet_args(urls: list[str], pd: tuple[int, int] | None) -> list[str]:
    """`gateway serve` flags naming the replicas: `--backend` each on an aggregated fleet,
    `--prefill` for the first P and `--decode` for the rest on a P/D one."""
    if pd is None:
        return [a for u in urls for a in ("--backend", u)]
    return [a for i, u in enumerate(urls)
            for a in ("--prefill" if i < pd[0] else "--decode", u)]


def gateway_env(reuse: bool, time_scale: float) -> dict[str, str]:
    if not reuse:
        return {}
    ttl = PdConfig().reuse_ttl_s * time_scale
    return {"GATEWAY_PD__REUSE_DECODER_KV": "true", "GATEWAY_PD__REUSE_TTL_S": f"{ttl:g}"}
