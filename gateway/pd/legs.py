"""The two legs' bodies and what is read back from the prefill leg's answer (pure).

As vLLM's own reference proxy and every peer router do it (real-vllm-pd.md):

- prefill leg, to P: the client's body with fresh `kv_transfer_params` (`FRESH`: P keeps
  the prompt's KV for a remote decoder), `stream: false`, `max_tokens: 1` (and
  `max_completion_tokens: 1` when the client sent it), no `stream_options`, no
  `min_tokens` (a minimum above 1 would contradict the one token asked);
- decode leg, to D: the client's body as it goes to a single replica (streamed or not,
  `min_tokens` kept), with P's answer's `kv_transfer_params` copied verbatim: D pulls the
  prompt's KV from P with them.

Both legs carry the same `X-Request-Id` (the request path's). A `kv_transfer_params` the
client sent never goes upstream on either leg: the gateway's replaces it (a client's own
would make an engine load whatever blocks it names).

The endpoints whose vLLM (0.32) requests accept `kv_transfer_params` and whose answers
return them, and how each names its output limit (`prefill_body` per endpoint):
- chat, completions: `max_tokens` (and chat's `max_completion_tokens` when sent);
- responses (`/v1/responses`, vLLM's entrypoints/openai/responses/protocol.py: the field
  goes to the sampler's extra_args; the response object carries P's): `max_output_tokens`.
  The prefill leg also gets `store: false` (P would otherwise keep a one-token response
  under an id the client never sees, in an unbounded store) and no `background` (a
  background leg answers "queued" without P's params; and vLLM refuses background
  without store);
- messages (`/v1/messages`, entrypoints/anthropic/protocol.py: passed to the chat
  request vLLM runs; a prefill leg with `do_remote_decode` skips the thinking-budget
  check, since its `max_tokens` 1 is below any budget): `max_tokens`.
Every other field is left as the client sent it: the prefill leg's prompt must render to
the very tokens the decode leg's does (`instructions`, `reasoning`, `thinking`, tools,
`cache_salt` all shape it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import orjson

FRESH: Mapping[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}


Endpoint = Literal["chat", "completions", "responses", "messages"]
ENDPOINTS: tuple[Endpoint, ...] = ("chat", "completions", "responses", "messages")


def prefill_body(body: Mapping[str, Any], pulled: Mapping[str, Any] | None = None,
                 endpoint: Endpoint = "chat") -> dict[str, Any]:
    """The prefill leg's body for `endpoint`. `pulled`: the decoder's params of the
    conversation's last turn (`[pd] reuse_decoder_kv`, checked by the caller to extend it
    exactly), which let P pull that turn's KV from D instead of computing it; sent with
    `do_remote_decode` true, as vLLM's bidirectional example does."""
    out = dict(body)
    out["kv_transfer_params"] = ({**pulled, "do_remote_decode": True} if pulled is not None
                                 else dict(FRESH))
    out["stream"] = False
    if endpoint == "responses":
        out["max_output_tokens"] = 1
        out["store"] = False
        out.pop("background", None)
    else:
        out["max_tokens"] = 1
    if endpoint in ("chat", "completions") and "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    return out


def decode_body(body: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """The decode leg's body: the client's, with P's params verbatim."""
    out = dict(body)
    out["kv_transfer_params"] = dict(params)
    return out


def answer_params(answer: bytes) -> dict[str, Any] | None:
    """P's `kv_transfer_params` from its (non-streamed) answer, None when it has none (an
    engine without a KV connector answers a plain completion: there is nothing to pull)."""
    try:
        doc = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    params = doc.get("kv_transfer_params") if isinstance(doc, dict) else None
    return params if isinstance(params, dict) and params else None


def transferred_tokens(params: Mapping[str, Any], prompt_tokens: int | None) -> int | None:
    """The prompt tokens whose KV P offered D: vLLM's `remote_num_tokens`, else P's
    prompt."""
    n = params.get("remote_num_tokens")
    if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
        return n
    return prompt_tokens
