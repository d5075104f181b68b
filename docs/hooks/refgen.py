"""The site's generated references, built from the code at `mkdocs build` (never committed).

- Configuration: every section of `gateway.settings.SECTIONS` and `[[replicas]]`, read from
  the dataclasses themselves: each field's name, its type as the settings parser resolves
  it (`gateway.coerce.field_types`, so a `Literal` shows its choices), its default, its
  environment variable, and the comments written beside it in the source (a comment block
  above a run of fields describes each of them; a comment on the field's own line too).
- Metrics: every family of the gateway's own registry (`GatewayMetrics` and the upstream
  counters registered on it), with its type, labels, help text and who may read it
  (`gateway.usage.exposure`).

A page asks for one with a marker line, `<!-- generated: settings -->` or
`<!-- generated: metrics -->`, which `on_page_markdown` replaces.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import typing
from collections.abc import Mapping
from typing import Any, NamedTuple

MARKERS = ("settings", "metrics")


class FieldDoc(NamedTuple):
    name: str
    type: str
    default: str
    doc: str


def _comments_by_line(source: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def field_comments(cls: type[Any]) -> dict[str, str]:
    """Field name -> the comments that describe it in `cls`'s source."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments = _comments_by_line(source)
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    fields = {
        node.lineno: (node.target.id, node.end_lineno or node.lineno)
        for node in body.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }
    out: dict[str, str] = {}
    # The comment block in force: it describes the field below it, and the fields after
    # that one while none of them has a comment of its own (a run the block names).
    block: list[str] = []
    after_statement = True
    # from the line after `class ...:`, so a comment block above the first field counts
    line_no = body.lineno + 1
    while line_no <= len(lines):
        text = lines[line_no - 1].strip()
        if line_no in fields:
            name, end = fields[line_no]
            own = [comments[n] for n in range(line_no, end + 1) if n in comments]
            first_below = not after_statement
            if own and not first_below:
                block = []  # a field with its own comment is not part of the run above
            out[name] = " ".join([*block, *own])
            if own:
                block = []  # and it ends the run
            after_statement, line_no = True, end + 1
            continue
        if not text:
            block, after_statement = [], True
        elif text.startswith("#"):
            if after_statement:
                block = []
            block.append(comments.get(line_no, text.lstrip("#").strip()))
            after_statement = False
        else:  # another statement (a method, a docstring): its comments end here
            block, after_statement = [], True
        line_no += 1
    return out


def _type_text(hint: Any) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return " | ".join(f'`"{v}"`' if isinstance(v, str) else f"`{v}`"
                            for v in typing.get_args(hint))
    text = repr(hint) if not isinstance(hint, type) else hint.__name__
    return "`" + text.replace("typing.", "").replace("collections.abc.", "") + "`"


def _toml(value: Any, size: bool = False) -> str:
    """`value` as TOML writes it; `size`: a byte count, shown in KiB or MiB too."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '""' if not value else f'"{value}"'
    if isinstance(value, (tuple, list, frozenset, set)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if size and isinstance(value, int) and value >= 1024 and value % 1024 == 0:
        kib = value // 1024
        unit = f"{kib // 1024} MiB" if kib % 1024 == 0 else f"{kib} KiB"
        return f"{value} ({unit})"
    return repr(value)


def field_docs(cls: type[Any]) -> list[FieldDoc]:
    """One entry per settable field of a settings dataclass, in declaration order."""
    from gateway.coerce import field_types

    types_ = field_types(cls)
    comments = field_comments(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            default = f"`{_toml(f.default, size='bytes' in f.name)}`"
        elif f.default_factory is not dataclasses.MISSING:
            default = f"`{_toml(f.default_factory())}`"
        else:
            default = "required"
        out.append(FieldDoc(f.name, _type_text(types_[f.name]), default,
                            comments.get(f.name, "")))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def settings_reference() -> str:
    """Markdown: one table per section, from the settings' own definitions."""
    from gateway.settings import SECTIONS, ReplicaSettings

    parts: list[str] = []
    sections: list[tuple[str, type[Any]]] = [*SECTIONS.items()]
    sections.insert(1, ("replicas", ReplicaSettings))
    for section, cls in sections:
        heading = "[[replicas]]" if section == "replicas" else f"[{section}]"
        doc = inspect.getdoc(cls) or ""
        # (a dataclass without a docstring gets its signature as one: not a description)
        own_doc = doc and not doc.startswith(f"{cls.__name__}(")
        intro = doc.split("\n\n")[0].replace("\n", " ") if own_doc else ""
        parts.append(f"### `{heading}`\n\n`{cls.__module__}.{cls.__name__}`"
                     + (f": {intro}" if intro else "") + "\n")
        env = ("one table per replica; `GATEWAY_BACKENDS=url,url` replaces them"
               if section == "replicas" else f"`GATEWAY_{section.upper()}__<KEY>`")
        parts.append(f"Environment: {env}.\n")
        parts.append("| key | type | default | meaning |\n|---|---|---|---|")
        for fd in field_docs(cls):
            parts.append(f"| `{fd.name}` | {_cell(fd.type)} | {_cell(fd.default)} | "
                         f"{_cell(fd.doc)} |")
        parts.append("")
    return "\n".join(parts)


class MetricDoc(NamedTuple):
    name: str  # as exposed (a counter with `_total`)
    type: str
    labels: tuple[str, ...]
    help: str
    audience: str


def metric_docs() -> list[MetricDoc]:
    """Every family of the gateway's registry, as a fresh gateway exposes it."""
    from prometheus_client.metrics import MetricWrapperBase

    from gateway.pd.metrics import PdMetrics
    from gateway.tracing.otel import SpanCounters
    from gateway.upstream.counters import UpstreamCounters
    from gateway.usage.exposure import FLEET_METRICS, ROUTED_METRICS
    from gateway.usage.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    UpstreamCounters(metrics.registry)  # serve registers these on the same registry
    PdMetrics(metrics.registry)  # ... and P/D's (gateway.pd.metrics)
    SpanCounters(metrics.registry)  # ... and these with [tracing] enabled
    # The collectors registered, read for their label names (a family with labels has no
    # sample before its first observation, so the rendered text cannot give them).
    collectors = [c for c in metrics.registry._collector_to_names
                  if isinstance(c, MetricWrapperBase)]
    out = []
    for c in collectors:
        name, kind = c._name, c._type
        exposed = name + "_total" if kind == "counter" else name
        if name in ROUTED_METRICS:
            audience = "fleet-wide (tenant-scoped where the index is shared)"
        elif name in FLEET_METRICS:
            audience = "fleet-wide"
        else:
            audience = "tenant-scoped (admin keys)"
        out.append(MetricDoc(exposed, kind, tuple(c._labelnames), c._documentation,
                             audience))
    return sorted(out)


def metrics_reference() -> str:
    rows = ["| metric | type | labels | meaning | who reads it |", "|---|---|---|---|---|"]
    for m in metric_docs():
        labels = ", ".join(f"`{label}`" for label in m.labels) or "none"
        rows.append(f"| `{m.name}` | {m.type} | {labels} | {_cell(m.help)} | {m.audience} |")
    return "\n".join(rows) + "\n"


def expand(markdown: str) -> str:
    """The page with each marker replaced by its generated reference."""
    for marker, make in (("settings", settings_reference), ("metrics", metrics_reference)):
        tag = f"<!-- generated: {marker} -->"
        if tag in markdown:
            markdown = markdown.replace(tag, make())
    return markdown


def on_page_markdown(markdown: str, **_: Any) -> str:
    """mkdocs hook."""
    return expand(markdown)
