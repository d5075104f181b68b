"""Hypothesis strategies shared by the property tests: JSON-like values, chat messages and
request bodies shaped like what clients send, including wrong shapes."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

# Text that exercises the scanners: unicode, control characters, digits and separators.
text = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=200
)
ascii_text = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=60)

json_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
    text,
)
json_value: st.SearchStrategy[Any] = st.recursive(
    json_scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(ascii_text, inner, max_size=4)
    ),
    max_leaves=12,
)

roles = st.sampled_from(["system", "user", "assistant", "tool", "developer"])
content = st.one_of(
    text, st.none(),
    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=3),
    json_value,
)
tool_call = st.fixed_dictionaries({
    "id": ascii_text, "type": st.just("function"),
    "function": st.fixed_dictionaries({"name": ascii_text, "arguments": st.one_of(text,
                                                                                 json_value)}),
})
message = st.one_of(
    st.fixed_dictionaries({"role": roles, "content": content},
                          optional={"tool_calls": st.lists(tool_call, max_size=2),
                                    "tool_call_id": ascii_text, "name": ascii_text}),
    json_value,
)
chat_body = st.fixed_dictionaries(
    {"model": st.one_of(ascii_text, json_value),
     "messages": st.one_of(st.lists(message, max_size=6), json_value)},
    optional={"tools": st.one_of(st.lists(json_value, max_size=3), json_value),
              "cache_salt": st.one_of(ascii_text, json_value),
              "stream": st.one_of(st.booleans(), json_value),
              "prompt_cache_key": st.one_of(ascii_text, json_value)},
)
completion_body = st.fixed_dictionaries(
    {"model": st.one_of(ascii_text, json_value),
     "prompt": st.one_of(text, st.lists(text, max_size=3),
                         st.lists(st.integers(-5, 2**33), max_size=20), json_value)},
)
plain_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"]), "content": text})
