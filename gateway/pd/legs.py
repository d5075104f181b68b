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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

FRESH: Mapping[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}


def prefill_body(body: Mapping[str, Any], pulled: Mapping[str, Any] | None = None,
                 ) -> dict[str, Any]:
    """The prefill leg's body. `pulled`: the decoder's params of the conversation's last
    turn (`[pd] reuse_decoder_kv`, checked by the caller to extend it exactly), which let
    P pull that turn's KV from D instead of computing it; sent with `do_remote_decode`
    true, as vLLM's bidirectional example does."""
    out = dict(body)
    out["kv_transfer_params"] = ({**pulled, "do_remote_decode": True} if pulled is not None
                                 else dict(FRESH))
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
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
