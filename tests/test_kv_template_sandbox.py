"""The chat-template sandbox's shortcut for `message.key` on plain dicts renders exactly
what Jinja's own immutable sandbox renders (the one transformers and vLLM use), for the
test model's template, the simulator's ChatML-with-tools shapes, and hostile keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from gateway.tokens.template import ChatTemplate, TemplateError, load_template

MODEL = Path(__file__).parent / "data" / "tiny-model"


def stock(template: ChatTemplate) -> Any:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = template._compiled.environment.filters["tojson"]
    env.globals["raise_exception"] = template._compiled.environment.globals[
        "raise_exception"]
    return env.from_string(template.source)


def both(template: ChatTemplate, messages: list[Any], tools: list[Any] | None) -> tuple[str, str]:
    ours = template.render(messages, tools)
    theirs = str(stock(template).render(messages=messages, tools=tools,
                                        add_generation_prompt=True, **template.special))
    return ours, theirs


TOOL = {"type": "function", "function": {"name": "f", "description": "d",
                                         "parameters": {"type": "object"}}}

message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]),
     "content": st.one_of(st.text(max_size=40), st.none())},
    optional={"items": st.text(max_size=5), "get": st.text(max_size=5),
              "name": st.text(max_size=5), "tool_call_id": st.text(max_size=5),
              "tool_calls": st.lists(st.fixed_dictionaries(
                  {"function": st.fixed_dictionaries(
                      {"name": st.text(max_size=5), "arguments": st.dictionaries(
                          st.text(max_size=3), st.integers(), max_size=2)})}), max_size=2)})


@settings(max_examples=300, deadline=None)
@given(st.lists(message, min_size=1, max_size=6), st.booleans())
def test_renders_what_the_stock_sandbox_renders(messages: list[dict[str, Any]],
                                                with_tools: bool) -> None:
    template = load_template(MODEL)
    tools = [TOOL] if with_tools else None
    try:
        ours, theirs = both(template, messages, tools)
    except TemplateError:
        with pytest.raises(Exception):  # noqa: B017 - the stock sandbox fails too
            stock(template).render(messages=messages, tools=tools,
                                   add_generation_prompt=True, **template.special)
        return
    assert ours == theirs


@pytest.mark.parametrize("source", [
    "{{ m.items }}", "{{ m.get('role') }}", "{{ m.missing is defined }}", "{{ m.role }}",
    "{% for k, v in m.items() %}{{ k }}={{ v }};{% endfor %}", "{{ m.__class__ }}",
])
def test_dict_attributes_keep_the_sandbox_path(source: str) -> None:
    template = ChatTemplate.from_source("{% set m = messages[0] %}" + source)
    msgs = [{"role": "user", "content": "hi", "items": "shadow"}]
    ours = template.render(msgs)
    theirs = str(stock(template).render(messages=msgs, tools=None,
                                        add_generation_prompt=True))
    assert ours == theirs


def test_unsafe_attributes_stay_refused() -> None:
    template = ChatTemplate.from_source("{{ messages[0].__class__.__mro__ }}")
    with pytest.raises((TemplateError, SecurityError)):
        template.render([{"role": "user", "content": "x"}])
