"""The README and the documentation site: the README's size and set-up commands, its links,
and the references the site generates from the code (docs/hooks/refgen.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gateway.settings import SECTIONS, ReplicaSettings, scan_env
from gateway.usage.metrics import DOCUMENTED_METRICS
from tests.docs_blocks import ROOT

README = ROOT / "README.md"
INSTALL_AND_RUN = "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/gateway serve"
TESTS = (".venv/bin/pip install -e '.[test,realengine]' && "
         ".venv/bin/python -m gateway.tracing.protofix && .venv/bin/python -m pytest")


def _refgen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("refgen", ROOT / "docs" / "hooks" / "refgen.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


refgen = _refgen()


def _sh_blocks(text: str) -> list[str]:
    return [m.strip() for m in re.findall(r"```sh\n(.*?)```", text, re.S)]


def test_readme_is_short() -> None:
    assert len(README.read_text().splitlines()) <= 200


def test_readme_set_up_is_the_two_commands_and_ci_runs_the_second() -> None:
    blocks = _sh_blocks(README.read_text())
    assert blocks[:2] == [INSTALL_AND_RUN, TESTS]
    # .ci/run installs from nothing and runs the README's test command as written
    assert TESTS in (ROOT / ".ci" / "run").read_text()


def test_readme_tour_has_its_five_stops() -> None:
    text = README.read_text()
    for stop in ("**A request**", "**A cached follow-up**", "**A finding and its fix**",
                 "**The page**", "--preset tiny"):
        assert stop in text, stop


def test_readme_and_docs_relative_links_resolve() -> None:
    pages = [README, *sorted((ROOT / "docs").glob("**/*.md"))]
    broken = []
    for page in pages:
        if "results" in page.relative_to(ROOT).parts[1:2] or page.is_symlink():
            continue
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken


# --- the configuration reference, from the settings' own definitions -----------------

@pytest.mark.parametrize(("cls", "field", "words"), [
    # a comment on the field's own line
    (SECTIONS["server"], "max_body_bytes", "larger requests get 413"),
    # a comment block above the field
    (SECTIONS["server"], "forget_after_s", "loses its routing memory"),
    # a comment block above a run of fields describes each of them
    (SECTIONS["routing"], "ratio_ewma_alpha", "EWMA weight"),
    (SECTIONS["routing"], "anchor_capacity", "EWMA weight"),
    (ReplicaSettings, "kv_events_endpoint", "tcp://host:port of the PUB socket"),
    (ReplicaSettings, "kv_events_endpoint", "Where it publishes KV events"),
])  # fmt: skip
def test_field_comments_come_from_the_source(cls: type[Any], field: str, words: str) -> None:
    assert words in refgen.field_comments(cls)[field]


def test_a_blank_line_ends_a_comment_block() -> None:
    comments = refgen.field_comments(SECTIONS["server"])
    assert "loses its routing memory" not in comments["probe_connections"]
    assert comments["log_level"] == ""
    # a field with its own comment is no part of the run the block above describes
    assert comments["upstream_idle_s"] == "idle upstream connections closed after (< vLLM's 5 s)"


@pytest.mark.parametrize(("value", "shown"), [
    (None, "none"), (True, "true"), ("", '""'), ("prefix", '"prefix"'), (("a", "b"), '["a", "b"]'),
    ({}, "{}"), (5.0, "5.0"), (8080, "8080"), (1024, "1024"),
])  # fmt: skip
def test_defaults_are_shown_as_toml(value: object, shown: str) -> None:
    assert refgen._toml(value) == shown


@pytest.mark.parametrize(("value", "shown"), [
    (32 * 1024 * 1024, "33554432 (32 MiB)"), (64 * 1024, "65536 (64 KiB)"), (1000, "1000"),
])  # fmt: skip
def test_byte_sizes_are_shown_in_units(value: int, shown: str) -> None:
    assert refgen._toml(value, size=True) == shown


def test_every_setting_of_every_section_is_in_the_reference() -> None:
    text = refgen.settings_reference()
    for section, cls in [*SECTIONS.items(), ("replicas", ReplicaSettings)]:
        heading = "[[replicas]]" if section == "replicas" else f"[{section}]"
        part = text.split(f"### `{heading}`")[1].split("### ")[0]
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in part, (section, f.name)


def test_reference_rows_carry_type_default_and_meaning() -> None:
    rows = {fd.name: fd for fd in refgen.field_docs(SECTIONS["server"])}
    assert rows["log_level"].type == '`"debug"` | `"info"` | `"warning"` | `"error"`'
    assert rows["port"].default == "`8080`"
    assert rows["host"].default == '`"127.0.0.1"`'
    assert "keep-alive" in rows["upstream_connections"].doc
    replica = {fd.name: fd for fd in refgen.field_docs(ReplicaSettings)}
    assert replica["name"].default == "required"


# --- the metrics reference, from the registry -----------------------------------------

def test_every_documented_metric_is_in_the_reference_with_its_labels() -> None:
    docs = {m.name: m for m in refgen.metric_docs()}
    assert set(DOCUMENTED_METRICS) <= set(docs)
    assert "gateway_upstream_failures_total" in docs
    assert docs["gateway_requests_total"].labels == ("model", "replica", "tenant", "route",
                                                     "status")
    assert docs["gateway_requests_total"].type == "counter"
    assert docs["gateway_ttft_seconds"].type == "histogram"
    assert docs["gateway_replica_healthy"].audience == "fleet-wide"
    assert docs["gateway_cached_tokens_total"].audience.startswith("tenant-scoped")
    assert docs["gateway_requests_total"].help == "Proxied requests by outcome."


def test_markers_are_replaced_and_other_text_kept() -> None:
    page = "intro\n\n<!-- generated: metrics -->\n\n<!-- generated: settings -->\nend\n"
    out = refgen.expand(page)
    assert "<!-- generated" not in out
    assert out.startswith("intro\n") and out.endswith("end\n")
    assert "`gateway_requests_total`" in out and "### `[server]`" in out


def test_the_reference_pages_ask_for_their_tables() -> None:
    assert "<!-- generated: settings -->" in (ROOT / "docs/reference/configuration.md").read_text()
    assert "<!-- generated: metrics -->" in (ROOT / "docs/reference/metrics.md").read_text()


def test_generated_output_is_not_committed() -> None:
    # the site is built into build/ (ignored); the pages hold markers, not tables
    assert "site_dir: build/site" in (ROOT / "mkdocs.yml").read_text()
    assert "| `upstream_idle_s` |" not in "".join(
        p.read_text() for p in Path(ROOT / "docs").rglob("*.md") if not p.is_symlink())


def test_ci_builds_the_site_strictly() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    line = next(line for line in ci.splitlines() if "mkdocs build" in line)
    # --quiet hides the warnings --strict counts: a broken link would pass
    assert "--strict" in line and "--quiet" not in line and "-q" not in line.split()
    assert ".[docs]" in ci and "set -euo pipefail" in ci


@pytest.mark.parametrize("section", [*SECTIONS, "replicas"])
def test_every_commented_field_has_its_meaning(section: str) -> None:
    """A field with a comment on its line or right above it (the first field of a class
    included) gets a meaning in the reference: none is dropped by the reader."""
    cls = ReplicaSettings if section == "replicas" else SECTIONS[section]
    lines = inspect.getsource(cls).splitlines()
    names = {f.name for f in dataclasses.fields(cls)}
    docs = refgen.field_comments(cls)
    for i, line in enumerate(lines):
        m = re.match(r"\s+(\w+): [^=]+(=|$)", line)
        if not m or m.group(1) not in names:
            continue
        above = lines[i - 1].strip().startswith("#")
        if above or "  # " in line:
            assert docs.get(m.group(1)), (section, m.group(1))


def test_each_sections_environment_variable_sets_its_fields() -> None:
    """The variable the reference gives for a section, with a field's name for <KEY>, is
    the one the settings read for that field (spelt as written, not only as parsed)."""
    text = refgen.settings_reference()
    checked = 0
    for section, cls in SECTIONS.items():
        part = text.split(f"### `[{section}]`")[1].split("### ")[0]
        pattern = re.search(r"Environment: `([A-Z_]+<KEY>)`", part)
        assert pattern, section
        for f in dataclasses.fields(cls):
            value = f.default
            if not f.init or not isinstance(value, (int, float, str)):  # bool is an int
                continue
            shown = ("true" if value else "false") if isinstance(value, bool) else str(value)
            name = pattern.group(1).replace("<KEY>", f.name.upper())
            scan = scan_env({name: shown})
            assert not scan.unknown and scan.sections == {section: {f.name: value}}, name
            checked += 1
    assert checked > 100
