"""Every block of README.md and docs/ marked runnable runs, against real servers on loopback
where it needs them (tests/docs_blocks.py says how blocks are marked); the marker parser by
table."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs_blocks import (
    DOCUMENTED_ADDRESS,
    DRIVER,
    ROOT,
    Block,
    MarkerError,
    documented_pages,
    runnable_blocks,
)
from tests.servers import free_port, running, script

FENCE = "```"


@pytest.mark.parametrize(("text", "expected"), [
    # (lang, needs, code) of each block found
    (f"<!-- runnable -->\n{FENCE}sh\necho hi\n{FENCE}\n", [("sh", set(), "echo hi\n")]),
    (f"<!-- runnable: gateway -->\n\n{FENCE}python\nx = 1\n{FENCE}\n",
     [("python", {"gateway"}, "x = 1\n")]),
    (f"<!-- runnable: gateway, promtool -->\n{FENCE}bash\ntrue\n{FENCE}\n",
     [("sh", {"gateway", "promtool"}, "true\n")]),
    (f"{FENCE}sh\nnot marked\n{FENCE}\n", []),
    (f"<!-- not runnable -->\n{FENCE}sh\nx\n{FENCE}\n", []),
    (f"<!-- runnable -->\n{FENCE}sh\na\n{FENCE}\ntext\n{FENCE}python\nb\n{FENCE}\n"
     f"<!-- runnable -->\n{FENCE}py\nc\n{FENCE}\n",
     [("sh", set(), "a\n"), ("python", set(), "c\n")]),
    # a fence of four backticks holds a three-backtick line
    (f"<!-- runnable -->\n````sh\n{FENCE}\n````\n", [("sh", set(), f"{FENCE}\n")]),
])  # fmt: skip
def test_marked_blocks_are_found(text: str, expected: list[tuple[str, set[str], str]]) -> None:
    got = [(b.lang, set(b.needs), b.code) for b in runnable_blocks(text)]
    assert got == expected


@pytest.mark.parametrize("text", [
    "<!-- runnable -->\nplain text\n",  # no fence after the marker
    "<!-- runnable -->\n",
    f"<!-- runnable -->\n{FENCE}toml\nx = 1\n{FENCE}\n",  # a language that cannot run
    f"<!-- runnable -->\n{FENCE}sh\nnever closed\n",
])  # fmt: skip
def test_a_bad_marker_is_an_error(text: str) -> None:
    with pytest.raises(MarkerError):
        runnable_blocks(text)


def _pages_with_blocks() -> list[tuple[str, list[Block]]]:
    out = []
    for page in documented_pages():
        rel = str(page.relative_to(ROOT))
        blocks = runnable_blocks(page.read_text(), rel)
        if blocks:
            out.append((rel, blocks))
    return out


PAGES = _pages_with_blocks()


def test_the_readme_and_the_site_have_runnable_blocks() -> None:
    marked = {rel for rel, _ in PAGES}
    assert "README.md" in marked
    assert sum(len(b) for _, b in PAGES) >= 8


def run_blocks(blocks: list[Block], tmp: Path, env: dict[str, str], timeout: float) -> str:
    """Run one page's blocks in order; the driver's output (fails the test on a failure)."""
    spec = tmp / "blocks.json"
    spec.write_text(json.dumps([{"path": b.path, "line": b.line, "lang": b.lang,
                                 "code": b.code, "timeout": timeout} for b in blocks]))
    done = subprocess.run([sys.executable, "-c", DRIVER, str(spec)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout * (len(blocks) + 1))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    return out


@pytest.mark.parametrize(("page", "blocks"), PAGES, ids=[rel for rel, _ in PAGES])
def test_runnable_blocks_run(page: str, blocks: list[Block], tmp_path: Path) -> None:
    needs = set().union(*(b.needs for b in blocks))
    for tool in needs - {"gateway"}:
        if shutil.which(tool) is None:
            pytest.skip(f"{page} needs {tool}, not installed")
    env = dict(os.environ)
    # the console scripts and the interpreter of this environment come first
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["HOME"] = str(tmp_path)  # nothing a block writes lands in the real home
    if "gateway" not in needs:
        run_blocks(blocks, tmp_path, env, timeout=60)
        return
    port = free_port()
    address = f"127.0.0.1:{port}"
    blocks = [Block(b.path, b.line, b.lang, b.needs, b.code.replace(DOCUMENTED_ADDRESS, address))
              for b in blocks]
    argv = [*script("gateway"), "serve", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning"]
    with running(argv, [f"http://{address}/ready"], timeout=60, log_path=tmp_path / "gw.log"):
        run_blocks(blocks, tmp_path, env, timeout=60)


@pytest.mark.parametrize(("blocks", "passes"), [
    ([("sh", "true\n")], True),
    ([("sh", "false\necho after\n")], False),  # a failing command mid-block fails it
    ([("sh", "false | cat\n")], False),  # and in a pipe
    ([("sh", "echo $UNSET_IN_DOCS\n")], False),  # an unset variable is an error
    ([("python", "x = 2\n"), ("python", "assert x == 2\n")], True),  # a page's names shared
    ([("python", "raise SystemExit(3)\n")], False),
    ([("python", "assert False\n"), ("sh", "true\n")], False),  # the first failure stops it
])  # fmt: skip
def test_the_driver_fails_on_a_failing_block(blocks: list[tuple[str, str]], passes: bool,
                                              tmp_path: Path) -> None:
    made = [Block("page.md", n + 1, lang, frozenset(), code)
            for n, (lang, code) in enumerate(blocks)]
    env = {k: v for k, v in os.environ.items() if k != "UNSET_IN_DOCS"}
    if passes:
        run_blocks(made, tmp_path, env, timeout=30)
    else:
        with pytest.raises(AssertionError, match=r"FAILED page\.md"):
            run_blocks(made, tmp_path, env, timeout=30)
