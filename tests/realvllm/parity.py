"""Simulator parity with real vLLM: one set of request cases, run against both, compared.

For each case we observe the status, the JSON shape of the body (keys and value types, not
values: the simulator's tokenizer and text are not the model's) or, for streams, the
sequence of SSE events reduced to their kind and shape; usage objects are compared by their
keys; `/metrics` by the set of `vllm:` metric names. `compare()` lists the paths where the
two observations differ. Differences that remain by design are listed once, in
`KNOWN_DIFFERENCES`, each with the reason; the tier's test requires that the observed
differences are exactly those (a new one fails, and so does a fixed one still listed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

TOOL = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
}}  # fmt: skip


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    path: str
    body: Callable[[str], Any] | None = None  # model name -> JSON body
    raw: bytes | None = None  # a body sent as is (invalid JSON)
    stream: bool = False


def _chat(model: str, **kw: Any) -> dict[str, Any]:
    content = " ".join(f"parity word{i % 13}" for i in range(60))
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": 3, **kw}  # fmt: skip


CASES = [
    Case("models", "GET", "/v1/models"),
    Case("chat", "POST", "/v1/chat/completions", lambda m: _chat(m)),
    Case("chat repeat (cached)", "POST", "/v1/chat/completions", lambda m: _chat(m)),
    Case("chat stream + usage", "POST", "/v1/chat/completions",
         lambda m: _chat(m, stream=True, stream_options={"include_usage": True}), stream=True),
    Case("chat stream", "POST", "/v1/chat/completions", lambda m: _chat(m, stream=True),
         stream=True),
    Case("completions", "POST", "/v1/completions",
         lambda m: {"model": m, "prompt": "parity " * 50, "max_tokens": 3}),
    Case("completions short prompt", "POST", "/v1/completions",
         lambda m: {"model": m, "prompt": "hi", "max_tokens": 2}),
    Case("completions stream + usage", "POST", "/v1/completions",
         lambda m: {"model": m, "prompt": "parity " * 50, "max_tokens": 3, "stream": True,
                    "stream_options": {"include_usage": True}}, stream=True),
    Case("chat tool_choice auto", "POST", "/v1/chat/completions",
         lambda m: _chat(m, tools=[TOOL], tool_choice="auto")),
    Case("chat tools, tool_choice none", "POST", "/v1/chat/completions",
         lambda m: _chat(m, tools=[TOOL], tool_choice="none")),
    Case("error: unknown model", "POST", "/v1/chat/completions", lambda m: _chat("nope")),
    Case("error: messages not a list", "POST", "/v1/chat/completions",
         lambda m: {"model": m, "messages": "x"}),
    Case("error: prompt over max_model_len", "POST", "/v1/chat/completions",
         lambda m: {**_chat(m), "messages": [{"role": "user", "content": "long " * 5000}]}),
    Case("error: max_tokens over max_model_len", "POST", "/v1/completions",
         lambda m: {"model": m, "prompt": "x", "max_tokens": 100000}),
    Case("error: stream_options without stream", "POST", "/v1/chat/completions",
         lambda m: _chat(m, stream_options={"include_usage": True})),
    Case("error: empty tools", "POST", "/v1/chat/completions", lambda m: _chat(m, tools=[])),
    Case("error: invalid JSON", "POST", "/v1/chat/completions", raw=b"{not json"),
    Case("tokenize prompt", "POST", "/tokenize", lambda m: {"model": m, "prompt": "hello"}),
    Case("tokenize messages", "POST", "/tokenize",
         lambda m: {"model": m, "messages": _chat(m)["messages"]}),
    Case("version", "GET", "/version"),
    Case("reset_prefix_cache (dev mode)", "POST", "/reset_prefix_cache"),
    Case("unknown path", "GET", "/nope"),
]  # fmt: skip

# Cases for a server started WITHOUT --enable-auto-tool-choice and without dev mode.
PLAIN_CASES = [
    Case("plain: tool_choice auto", "POST", "/v1/chat/completions",
         lambda m: _chat(m, tools=[TOOL], tool_choice="auto")),
    Case("plain: tools without tool_choice", "POST", "/v1/chat/completions",
         lambda m: _chat(m, tools=[TOOL])),
    Case("plain: reset_prefix_cache", "POST", "/reset_prefix_cache"),
]  # fmt: skip


def shape(value: Any) -> Any:
    """Keys and value types; a list is the union of its items' shapes (first one kept)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if value is None:
        return "null"
    return {bool: "bool", int: "int", float: "float", str: "str"}.get(type(value), "?")


def _event(data: str) -> Any:
    if data == "[DONE]":
        return "[DONE]"
    chunk = orjson.loads(data)
    choices = chunk.get("choices") or []
    if not choices:
        kind = "usage" if "usage" in chunk else "empty"
    elif choices[0].get("finish_reason"):
        kind = "finish"
    elif "role" in (choices[0].get("delta") or {}):
        kind = "role"
    else:
        kind = "content"
    return {"kind": kind, **shape(chunk)}


def _is_content(event: Any) -> bool:
    return isinstance(event, dict) and event["kind"] == "content"


def observe(base: str, case: Case, model: str) -> dict[str, Any]:
    """What the server at `base` answers to `case`: status and body shape (or events)."""
    url = base + case.path
    kw: dict[str, Any] = {"timeout": 120}
    if case.raw is not None:
        kw["content"] = case.raw
        kw["headers"] = {"content-type": "application/json"}
    elif case.body is not None:
        kw["json"] = case.body(model)
    if case.stream:
        with httpx.stream(case.method, url, **kw) as r:
            text = r.read().decode()
        events = [e.removeprefix("data: ") for e in text.split("\n\n") if e.startswith("data: ")]
        kinds: list[Any] = []
        for e in map(_event, events):
            # Runs of content chunks collapse to one: their number depends on the tokenizer.
            if _is_content(e) and kinds and _is_content(kinds[-1]):
                continue
            kinds.append(e)
        return {"status": r.status_code, "events": kinds}
    r = httpx.request(case.method, url, **kw)
    try:
        body: Any = shape(r.json()) if r.content else "empty"
    except ValueError:
        body = "not json"
    return {"status": r.status_code, "body": body}


def metric_names(base: str) -> set[str]:
    text = httpx.get(base + "/metrics", timeout=30).text
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line.startswith("vllm:")}  # fmt: skip


def compare(sim: Any, real: Any, path: str = "") -> list[str]:
    """Paths (`a.b[].c`) where two observations differ; `path: sim X, real Y` for leaves."""
    if isinstance(sim, dict) and isinstance(real, dict):
        out: list[str] = []
        for k in sorted(set(sim) | set(real), key=str):
            p = f"{path}.{k}" if path else str(k)
            if k not in sim:
                out.append(f"{p}: missing in sim")
            elif k not in real:
                out.append(f"{p}: extra in sim")
            else:
                out += compare(sim[k], real[k], p)
        return out
    if isinstance(sim, list) and isinstance(real, list):
        if len(sim) != len(real):
            return [f"{path}: sim {len(sim)} items, real {len(real)}"]
        out = []
        for i, (a, b) in enumerate(zip(sim, real, strict=True)):
            out += compare(a, b, f"{path}[{i}]")
        return out
    return [] if sim == real else [f"{path}: sim {sim!r}, real {real!r}"]


def run_all(
    sim: str, real: str, sim_plain: str, real_plain: str, model: str
) -> dict[str, list[str]]:
    """Every case against both servers, in order; the differences per case name."""
    diffs: dict[str, list[str]] = {}
    for cases, a, b in ((CASES, sim, real), (PLAIN_CASES, sim_plain, real_plain)):
        for case in cases:
            diffs[case.name] = compare(observe(a, case, model), observe(b, case, model))
    # `*_created` samples are prometheus_client's per-series timestamps, not metrics.
    sim_names, real_names = (
        {n for n in metric_names(u) if not n.endswith("_created")} for u in (sim, real)
    )
    diffs["metrics names"] = [f"{n}: missing in sim" for n in sorted(real_names - sim_names)] + [
        f"{n}: extra in sim" for n in sorted(sim_names - real_names)
    ]
    return diffs


def report(diffs: dict[str, list[str]]) -> str:
    lines = ["| case | result | differences (sim vs real vLLM 0.32) |", "|---|---|---|"]
    for name, found in diffs.items():
        known = KNOWN_DIFFERENCES.get(name, {})
        cell = "<br>".join(f"`{d}`" + (f" ({known[d]})" if d in known else " (NEW)")
                           for d in found)  # fmt: skip
        verdict = "match" if not found else ("known" if set(found) <= set(known) else "DIFFERS")
        lines.append(f"| {name} | {verdict} | {cell} |")
    return "\n".join(lines) + "\n"


# vLLM 0.32 series the simulator does not export: the gateway reads none of them (it reads
# cache config, KV usage, running/waiting, the prefix-cache counters and
# prompt_tokens_by_source, all simulated).
UNSIMULATED_METRICS = """admission_rejections_total engine_sleep_state estimated_flops_per_gpu_total
estimated_read_bytes_per_gpu_total estimated_write_bytes_per_gpu_total
external_prefix_cache_hits_total external_prefix_cache_queries_total
iteration_tokens_total_bucket iteration_tokens_total_count iteration_tokens_total_sum
mm_cache_hits_total mm_cache_queries_total num_requests_waiting_by_reason
prompt_tokens_cached_by_source_total
request_decode_time_seconds_bucket request_decode_time_seconds_count
request_decode_time_seconds_sum request_inference_time_seconds_bucket
request_inference_time_seconds_count request_inference_time_seconds_sum
request_max_num_generation_tokens_bucket request_max_num_generation_tokens_count
request_max_num_generation_tokens_sum request_num_preemptions_bucket
request_num_preemptions_count request_num_preemptions_sum request_params_max_tokens_bucket
request_params_max_tokens_count request_params_max_tokens_sum request_params_n_bucket
request_params_n_count request_params_n_sum request_prefill_kv_computed_tokens_bucket
request_prefill_kv_computed_tokens_count request_prefill_kv_computed_tokens_sum
request_prefill_time_seconds_bucket request_prefill_time_seconds_count
request_prefill_time_seconds_sum request_time_per_output_token_seconds_bucket
request_time_per_output_token_seconds_count request_time_per_output_token_seconds_sum
tool_call_parser_invocations_total""".split()  # noqa: SIM905  (a list literal: 43 lines)

# Differences that stay, by case: the exact `compare()` line -> why.
KNOWN_DIFFERENCES: dict[str, dict[str, str]] = {
    "metrics names": {
        f"vllm:{name}: missing in sim": "not simulated; the gateway does not read it"
        for name in UNSIMULATED_METRICS
    },
}
