"""PNG charts with matplotlib's Agg backend (no display needed).

- `turn_chart`: the tutorials' four panels for one endpoint (cache hit rate per turn,
  prompt growth, TTFT per turn, tokens served from cache per turn).
- `compare_chart`: the same per-turn panels with one line per policy, plus requests per
  replica (grouped bars) and cached ratio vs the bound per policy.

Figures are small (low dpi) because they are committed with the results. matplotlib is
the `bench` extra: importing this module without it raises `MissingExtra`, which
`gateway-bench` turns into an install hint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gateway.extras import require

_FEATURE = "gateway-bench (its charts)"
require("matplotlib", extra="bench", feature=_FEATURE).use("Agg")
plt = require("matplotlib.pyplot", extra="bench", feature=_FEATURE)

DPI = 72

_PANELS = (
    ("cached_ratio", "cache hit rate per turn", "cached / prompt tokens", 100.0),
    ("prompt_tokens", "prompt growth", "mean prompt tokens", 1.0),
    ("ttft_ms", "TTFT per turn (median)", "ms", 1.0),
    ("cached_tokens", "tokens served from cache", "mean cached tokens", 1.0),
)


def _turn_panels(axes: Sequence[Any], runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
    for ax, (key, title, ylabel, scale) in zip(axes, _PANELS, strict=True):
        for name, rows in runs.items():
            xs = [r["turn"] for r in rows if r.get(key) is not None]
            ys = [r[key] * scale for r in rows if r.get(key) is not None]
            ax.plot(xs, ys, marker="o", markersize=3, label=name)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("turn", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    if len(runs) > 1:
        axes[0].legend(fontsize=7)


def turn_chart(rows: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> Path:
    fig, axes = plt.subplots(2, 2, figsize=(9, 6))
    _turn_panels(list(axes.flat), {"run": rows})
    fig.suptitle(title or "per-turn cache behaviour", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def compare_chart(
    turns: Mapping[str, Sequence[Mapping[str, Any]]],
    summaries: Mapping[str, Mapping[str, Any]],
    path: Path,
    title: str = "",
) -> Path:
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    flat = list(axes.flat)
    _turn_panels([flat[0], flat[1], flat[3], flat[4]], turns)
    names = list(summaries)
    _replica_bars(flat[2], summaries)
    ratios = [100 * (summaries[n].get("cached_ratio") or 0.0) for n in names]
    bound = [100 * ((summaries[n].get("bound") or {}).get("ratio") or 0.0) for n in names]
    xs = range(len(names))
    flat[5].bar([x - 0.2 for x in xs], ratios, width=0.4, label="engine cached")
    flat[5].bar([x + 0.2 for x in xs], bound, width=0.4, label="bound")
    flat[5].set_xticks(list(xs), names, fontsize=8)
    flat[5].set_title("cached ratio vs bound", fontsize=10)
    flat[5].set_ylabel("% of prompt tokens", fontsize=8)
    flat[5].legend(fontsize=7)
    fig.suptitle(title or "policy comparison", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _replica_bars(ax: Any, summaries: Mapping[str, Mapping[str, Any]]) -> None:
    names = list(summaries)
    per = {n: (summaries[n].get("replica_requests") or {}).get("per_replica") or {} for n in names}
    replicas = sorted({r for counts in per.values() for r in counts})
    width = 0.8 / max(len(names), 1)
    for i, n in enumerate(names):
        xs = [j + i * width for j in range(len(replicas))]
        ax.bar(xs, [per[n].get(r, 0) for r in replicas], width=width, label=n)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(replicas))], replicas, fontsize=7)
    ax.set_title("requests per replica", fontsize=10)
    ax.legend(fontsize=7)
