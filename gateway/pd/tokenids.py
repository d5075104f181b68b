"""Token ids for `[pd] reuse_decoder_kv` in token mode (pure): the gateway asks the decode
leg for them, reads them, and hides them from a client that did not ask.

What D's KV holds after a turn is the prompt's token ids followed by the ids D generated,
less the last one (never fed forward): vLLM's `remote_num_tokens` in D's returned params
is `request.num_computed_tokens` (nixl/pull_scheduler.py `request_finished`), and P loads
`min(remote_num_tokens, its prompt's tokens)` positions of it unchecked. So the turn is
`(prompt ids + generated ids)[:remote_num_tokens]`, and the next prompt's ids must begin
with exactly those (gateway.pd.pullback). The generated ids are the ones vLLM reports,
the stop token included when one was sampled (it is in `token_ids`; its KV is not in D's
unless a token was generated after it, which `remote_num_tokens` says): a template that
renders another end token, or a text that re-tokenizes otherwise ("hell" + "o" sampled,
"hello" re-tokenized), differs in the ids, and the turn is prefilled afresh.

vLLM (0.32) returns the ids when the request says `return_token_ids: true`: a whole chat
answer at the top (`prompt_token_ids`) and per choice (`token_ids`); a whole completion
per choice (both); streamed, `prompt_token_ids` on the first chunk (chat: at the top;
completions: in the choice) and each chunk's own `token_ids`. Without the flag every one
of those fields is written as `null`, so the bytes the client would have got are the
same bytes with each list replaced by `null` (`IdsNuller`, which edits the bytes in
place: vLLM's JSON is left as written), except one thing the flag adds: a chat stream
sends a chunk for tokens it would otherwise hold back (a stop string's or a tool
parser's), with an empty delta and nothing else (`ids_only`): dropped.

The gateway asks only when the client did not (`asks_ids`) and when the answer can be
the one the client would have had: not with `echo` (vLLM then skips detokenizing the
prompt it echoes), not for `n` > 1 (nothing is kept for those), and not with `tools`: a
tool parser sends an empty delta of its own for each token after a finished call
(vllm/parser/mistral.py), byte for byte the chunk the flag makes, and the dropping would
take it too; an answer with tool calls is never kept anyway.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping
from typing import Any

KEYS = (b'"prompt_token_ids":[', b'"token_ids":[')
MARK = b'token_ids":['  # what both keys end with: the cheap test for an event


def asks_ids(body: Mapping[str, Any]) -> bool:
    """Whether the gateway adds `return_token_ids: true` to this decode leg (and strips
    what it adds): the client did not ask, and the flag changes nothing else it gets."""
    return (not body.get("return_token_ids") and not body.get("echo")
            and body.get("n") in (None, 1) and not body.get("tools"))


def pack(ids: list[int]) -> bytes | None:
    """The ids as fixed-width bytes (8, little-endian), so a prefix of the bytes is a
    prefix of the ids; None for an id that is not a uint64."""
    try:
        out = array("Q", ids)
    except (OverflowError, TypeError):
        return None
    if sys.byteorder == "big":
        out.byteswap()
    return out.tobytes()


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(type(v) is int for v in value):
        return value
    return None


def answer_ids(doc: Mapping[str, Any]) -> list[int] | None:
    """A whole chat or completions answer's prompt ids followed by choice 0's generated
    ids; None unless both are there and there is one choice."""
    choices = doc.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    prompt = _int_list(doc.get("prompt_token_ids"))
    if prompt is None:
        prompt = _int_list(choice.get("prompt_token_ids"))  # completions
    generated = _int_list(choice.get("token_ids"))
    if prompt is None or generated is None:
        return None
    return prompt + generated


class StreamIds:
    """A stream's prompt ids and choice 0's generated ids, read chunk by chunk; `ids`
    None when they cannot be told (another choice, a chunk with a choice and no ids, no
    prompt ids) or past `max_ids`."""

    def __init__(self, max_ids: int) -> None:
        self.max_ids = max_ids
        self._prompt: list[int] | None = None
        self._generated: list[int] = []
        self._known = True

    @property
    def ids(self) -> list[int] | None:
        if not self._known or self._prompt is None:
            return None
        return self._prompt + self._generated

    def read(self, doc: Mapping[str, Any]) -> None:
        if not self._known:
            return
        top = _int_list(doc.get("prompt_token_ids"))  # chat's first chunk
        if top is not None:
            self._take_prompt(top)
        choices = doc.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                self._known = False
                return
            prompt = _int_list(choice.get("prompt_token_ids"))  # completions' first chunk
            if prompt is not None:
                self._take_prompt(prompt)
            got = _int_list(choice.get("token_ids"))
            if got is None:
                # a chunk without ids (the role chunk's delta carries no token) tells
                # nothing; one with text or a finish and no ids: they are not all here
                delta = choice.get("delta")
                if choice.get("text") or choice.get("finish_reason") is not None or (
                        isinstance(delta, dict) and any(k != "role" and v for k, v in
                                                        delta.items())):
                    self._known = False
                    return
                continue
            self._generated.extend(got)
            if len(self._generated) + len(self._prompt or ()) > self.max_ids:
                self._known, self._generated = False, []
                return

    def _take_prompt(self, ids: list[int]) -> None:
        if self._prompt is not None or len(ids) > self.max_ids:
            self._known = False  # twice, or too long to hold
            return
        self._prompt = ids


def ids_only(doc: Mapping[str, Any]) -> bool:
    """A chat chunk vLLM sends only because the request asked for token ids: its choices
    carry ids and an empty delta, no finish and no logprobs (chat_completion/serving.py:
    a held-back token is skipped without `return_token_ids`)."""
    choices = doc.get("choices")
    if doc.get("object") != "chat.completion.chunk" or not isinstance(choices, list) \
            or not choices or doc.get("prompt_token_ids") is not None:
        return False
    return all(isinstance(c, dict) and c.get("delta") == {} and c.get("finish_reason") is None
               and c.get("logprobs") is None and _int_list(c.get("token_ids")) is not None
               for c in choices)


def null_doc(doc: Any) -> None:
    """Set every id list of a parsed answer or chunk to None, as vLLM writes them without
    the flag (for an event that is re-serialized anyway)."""
    if isinstance(doc, dict):
        for key in ("prompt_token_ids", "token_ids"):
            if isinstance(doc.get(key), list):
                doc[key] = None
        for value in doc.values():
            null_doc(value)
    elif isinstance(doc, list):
        for value in doc:
            null_doc(value)


class IdsNuller:
    """Bytes of compact JSON in, the same bytes with each `"prompt_token_ids":[...]` and
    `"token_ids":[...]` written `...:null`, in pieces (a chunk may end anywhere). A key is
    one only where `{` or `,` comes before its quote: inside a JSON string a quote is
    escaped, so the text of a message never matches."""

    def __init__(self) -> None:
        self._held = b""  # the end of the last piece that may begin a key
        self._before = b""  # the byte before `_held`
        self._in_list = False

    def feed(self, chunk: bytes) -> bytes:
        data = self._held + chunk
        before = self._before
        self._held = b""
        out: list[bytes] = []
        i = 0
        n = len(data)
        while i < n:
            if self._in_list:
                j = data.find(b"]", i)
                if j < 0:
                    self._before = data[-1:]
                    return b"".join(out)
                self._in_list = False
                i = j + 1
                continue
            hit = -1
            key = b""
            for k in KEYS:
                j = data.find(k, i)
                while j >= 0 and (data[j - 1:j] if j else before) not in (b"{", b","):
                    j = data.find(k, j + 1)
                if j >= 0 and (hit < 0 or j < hit):
                    hit, key = j, k
            if hit < 0:
                keep = _partial(data, i)
                out.append(data[i:n - keep])
                if keep:
                    self._held = data[n - keep:]
                    self._before = data[n - keep - 1:n - keep] if n - keep else before
                else:
                    self._before = data[-1:]
                return b"".join(out)
            out.append(data[i:hit] + key[:-1] + b"null")
            self._in_list = True
            i = hit + len(key)
        self._before = data[-1:] if data else before
        return b"".join(out)

    def finish(self) -> bytes:
        held, self._held = self._held, b""
        return held


def _partial(data: bytes, start: int) -> int:
    """How many bytes at the end of data[start:] may begin one of KEYS."""
    longest = 0
    for k in KEYS:
        for size in range(min(len(k) - 1, len(data) - start), longest, -1):
            if data.endswith(k[:size]):
                longest = size
                break
    return longest


def null_ids(data: bytes) -> bytes:
    """A whole answer's bytes with its id lists written `null` (unchanged without any)."""
    if MARK not in data:
        return data
    nuller = IdsNuller()
    return nuller.feed(data) + nuller.finish()


# Request fields that make vLLM render a chat prompt otherwise than the gateway's renderer
# (gateway.tokens.render renders the model's own template with its defaults)
_RENDER_FIELDS = ("chat_template", "chat_template_kwargs", "continue_final_message",
                  "documents", "mm_processor_kwargs")


# Request fields with which the ids vLLM prefills are not the prompt's ids as the gateway
# reads the body, in either mode, whatever their value: `truncate_prompt_tokens` cuts the
# prompt's first ids (its `truncation_side` defaults to the left), `reasoning_effort` is
# passed to the chat template (and sets its `enable_thinking`: chat_completion/protocol.py
# `build_chat_params`), `add_special_tokens` may add a BOS before them. A turn sending one
# is prefilled afresh (review: D's KV was handed to P for ids shifted by one).
SHIFT_FIELDS = ("truncate_prompt_tokens", "truncation_side", "reasoning_effort",
                "add_special_tokens")


def shifts_ids(body: Mapping[str, Any]) -> bool:
    """Whether vLLM's prefilled ids may not be the body's prompt as the gateway reads it."""
    return any(k in body for k in SHIFT_FIELDS)


def renders_alike(body: Mapping[str, Any]) -> bool:
    """Whether the gateway's renderer computes the ids vLLM does for this body, as far as
    the body can tell: none of the fields it does not render or that shift the ids, and
    only text content."""
    if any(body.get(k) for k in _RENDER_FIELDS) or shifts_ids(body):
        return False
    messages = body.get("messages")
    if messages is None:
        return True  # completions: the prompt is tokenized as sent
    if not isinstance(messages, list):
        return False
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and not all(
                isinstance(p, dict) and p.get("type") == "text" for p in content):
            return False
    return True
