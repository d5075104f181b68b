"""The code blocks of README.md and docs/ marked runnable, and a driver that runs them.

A block is marked by an HTML comment on the line before its fence (invisible on the page):

    <!-- runnable -->                 runs as it is
    <!-- runnable: gateway -->        needs `gateway serve` (embedded simulator) running; the
                                      documented 127.0.0.1:8080 is replaced by its address
    <!-- runnable: promtool -->       needs that program on PATH (skipped without it)

`sh` blocks run in bash with `set -euo pipefail`; `python` blocks run in one interpreter
per page, in order, sharing their names (a page's later block uses what an earlier one
made, as a reader's session would). A marker not followed by a fence is an error, so a
typo never silently drops a block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTED_ADDRESS = "127.0.0.1:8080"
_MARK = re.compile(r"^<!--\s*runnable(?::\s*(?P<needs>[\w ,-]*))?\s*-->\s*$")
_FENCE = re.compile(r"^(?P<fence>```+)\s*(?P<lang>[\w-]*)")
LANGS = {"sh": "sh", "bash": "sh", "shell": "sh", "console": "sh", "python": "python",
         "py": "python"}


class MarkerError(ValueError):
    pass


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository
    line: int  # the fence's line, 1-based
    lang: str  # "sh" or "python"
    needs: frozenset[str]
    code: str


def runnable_blocks(text: str, path: str = "<text>") -> list[Block]:
    """The marked blocks of one Markdown text, in order (pure)."""
    lines = text.splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        mark = _MARK.match(lines[i].strip())
        if not mark:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        fence = _FENCE.match(lines[j].strip()) if j < len(lines) else None
        if fence is None:
            raise MarkerError(f"{path}:{i + 1}: runnable marker not followed by a fenced block")
        lang = LANGS.get(fence["lang"].lower())
        if lang is None:
            raise MarkerError(f"{path}:{j + 1}: runnable block in {fence['lang']!r}, "
                              f"not one of {sorted(LANGS)}")
        end = j + 1
        while end < len(lines) and lines[end].strip() != fence["fence"]:
            end += 1
        if end == len(lines):
            raise MarkerError(f"{path}:{j + 1}: runnable block never closed")
        needs = frozenset(n.strip() for n in (mark["needs"] or "").replace(",", " ").split())
        out.append(Block(path, j + 1, lang, needs, "\n".join(lines[j + 1:end]) + "\n"))
        i = end + 1
    return out


def documented_pages(root: Path = ROOT) -> list[Path]:
    """README.md and every page under docs/ (the benchmark results linked in are data)."""
    pages = [root / "README.md"]
    pages += sorted(p for p in (root / "docs").rglob("*.md")
                    if not {"results", "hooks"} & set(p.relative_to(root / "docs").parts))
    return pages


# Run by the test as `python -c DRIVER blocks.json`: each block in order, stopping at the
# first that fails and naming it (exit 1).
DRIVER = r"""
import json, subprocess, sys, traceback
blocks = json.load(open(sys.argv[1]))
names = {"__name__": "__docs__"}
for b in blocks:
    where = f"{b['path']}:{b['line']}"
    print(f"--- {where} ({b['lang']})", flush=True)
    if b["lang"] == "python":
        try:
            exec(compile(b["code"], where, "exec"), names)
        except BaseException:
            traceback.print_exc()
            print(f"FAILED {where}", flush=True)
            sys.exit(1)
    else:
        rc = subprocess.run(["bash", "-c", "set -euo pipefail\n" + b["code"]],
                            timeout=b["timeout"]).returncode
        if rc != 0:
            print(f"FAILED {where}: exit status {rc}", flush=True)
            sys.exit(1)
    sys.stdout.flush()
"""
