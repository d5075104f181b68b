"""Turn two without re-prefill (`[pd] reuse_decoder_kv`): the decoder's returned
`kv_transfer_params`, kept per conversation (gateway.pd.reuse's `DecoderKvMemory`) and sent
with the conversation's next prefill leg, so P pulls the turn's KV back from D instead of
recomputing it.

What is checked, since the engine checks nothing (real-vllm-pd.md):
- the conversation: the client's session id, else the router's implicit conversation,
  both scoped by tenant; a request with neither is never given another's params;
- the tokens: D's KV covers the last turn's prompt and answer; its canonical bytes (the
  router's rendering: the prompt, the answer, and for chat the end of the message, as the
  next turn renders it) must begin the new prompt exactly (`DecoderKvMemory.take`), else
  the prefill is fresh;
- the template: the canonical bytes do not show what renders them into tokens, so both
  are prefixed with `template_tag` (the router's chain seed: model, cache_salt,
  `chat_template`, `chat_template_kwargs`, `continue_final_message`); the generation
  prompt is in the bytes already (normalize renders it unless `add_generation_prompt`
  is false), so a turn without it never begins the next one;
- the answer: one that carried reasoning is never remembered (PdPath.answered: D's KV
  holds the thinking, which the next turn does not send back);
- the replica: still the same one, not restarted since (its KV would be gone): the entry
  remembers the `Replica` object and the router's restart count of it, and an entry of a
  replica that left, was replaced or restarted is dropped.

Token mode (`[tokens]` names the model): by token ids (gateway.pd.tokenids). The engine's
KV is per token, and the same bytes can tokenize differently where the previous answer
meets the next turn's text (D may have sampled "hell" + "o" where the tokenizer says
"hello"), so a byte match proves nothing there. D's KV holds the prompt's ids followed by
the ids D generated, `remote_num_tokens` of them (the last sampled one is never computed);
the decode leg asks vLLM for them (`return_token_ids`, hidden again from a client that
did not ask: gateway.pd.answer), and the turn kept is those ids (vLLM's own, the prompt's
included), packed 8 bytes each after the template's tag (`token_turn`). `take` packs the
new prompt's ids as the router's renderer computes them (gateway.tokens.render, the
parity token mode relies on) and hands the params out only when they begin with exactly
the turn's. Ids unknown (the client or the engine gave none, n > 1, a stream past its
bounds, tool calls or reasoning, whose text the next turn renders otherwise): nothing
kept. A body that the renderer does not render as vLLM would (`renders_alike`: its own
`chat_template`, template kwargs, non-text content) is never handed params in token
mode. The gateway's renderer and vLLM disagreeing on the new prompt where they agree on
the old is the one risk left: it is the parity token mode's block hashes assume.

A streamed answer is remembered as a whole one is: the relay collects its text and its
final chunk's params (gateway.pd.answer; none for tool calls or n > 1). Bounds:
`reuse_max_conversations` entries for `reuse_ttl_s` (the memory's), and one record per
replica of the fleet (`_seen`, pruned to the fleet).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from gateway.pd.config import PdConfig
from gateway.pd.reuse import DecoderKvMemory
from gateway.pd.tokenids import pack, renders_alike, shifts_ids
from gateway.routing.normalize import END

if TYPE_CHECKING:  # collaborators passed in; importing them would tie gateway.pd to them
    from gateway.replicas.fleet import Fleet, Replica
    from gateway.routing.plan import RoutePlan
    from gateway.routing.router import Router


def conversation_key(plan: RoutePlan) -> str | None:
    """The conversation's key: its tenant and its session id or implicit conversation."""
    tenant = plan.tenant or ""
    if plan.session is not None:
        return f"{tenant}\x1fs{plan.session}"
    if plan.conversation is not None:
        return f"{tenant}\x1fc{plan.conversation}"
    return None


def template_tag(plan: RoutePlan) -> bytes:
    """What renders the canonical bytes into tokens, as bytes that begin both the stored
    turn and the compared prompt: the chain seed (normalize.chain_seed hashes the model,
    cache_salt and the template switches), so a switch is a mismatch."""
    return plan.seed.to_bytes(8, "big")


def turn_bytes(plan: RoutePlan, kind: Literal["chat", "completions"], reply: str) -> bytes:
    """The bytes D's KV covers after answering `reply`, as the next turn renders them
    (the router indexes a reply the same way), after the template's tag."""
    end = END.encode() if kind == "chat" else b""
    return template_tag(plan) + plan.data + reply.encode("utf-8", "surrogatepass") + end


def token_turn(plan: RoutePlan, ids: list[int] | None, params: Mapping[str, Any]
               ) -> bytes | None:
    """Token mode: the ids D's KV holds after the turn (the prompt's then the generated,
    `remote_num_tokens` of them: what P loads unchecked), packed after the template's
    tag; None when that cannot be told (no ids, no count, a count past the ids)."""
    held = params.get("remote_num_tokens")
    if ids is None or type(held) is not int or not 0 < held <= len(ids):
        return None
    packed = pack(ids[:held])
    return None if packed is None else template_tag(plan) + packed


class PullBack:
    def __init__(self, config: PdConfig, fleet: Fleet, router: Router) -> None:
        self.enabled = config.reuse_decoder_kv
        self.memory = DecoderKvMemory(config.reuse_max_conversations, config.reuse_ttl_s)
        self.fleet = fleet
        self.router = router
        # replica name -> (the Replica, its restart count) when its entries were made
        self._seen: dict[str, tuple[Replica, int]] = {}

    def token_mode(self, plan: RoutePlan) -> bool:
        """Whether this request's turns are checked by token ids."""
        return self.enabled and self.router.token_mode(plan.model)

    def remember(self, plan: RoutePlan, kind: Literal["chat", "completions"], replica: str,
                 reply: str | None, params: dict[str, Any] | None, now: float,
                 ids: list[int] | None = None) -> bool:
        """D (`replica`) answered `reply` and returned `params`: keep them for the
        conversation's next turn. `ids`: the answer's token ids (the prompt's then the
        generated), which token mode needs. False when nothing was kept."""
        key = conversation_key(plan)
        if not self.enabled or key is None or reply is None or params is None:
            return False
        if self.router.token_mode(plan.model):
            turn = token_turn(plan, ids, params)
            if turn is None:
                return False
        else:
            turn = turn_bytes(plan, kind, reply)
        if self._refresh(replica) == "gone":
            return False
        self.memory.remember(key, replica, turn, params, now)
        return True

    def take(self, plan: RoutePlan, now: float, body: Mapping[str, Any] | None = None,
             kind: Literal["chat", "completions"] = "chat") -> dict[str, Any] | None:
        """The params to send with this request's prefill leg, or None (fresh prefill).
        `body`, `kind`: the request, which token mode renders into ids (without them,
        nothing is handed out there)."""
        key = conversation_key(plan)
        if not self.enabled or key is None or key not in self.memory:
            return None
        if self.router.token_mode(plan.model):
            ids = (self.router.prompt_ids(body, kind, plan.model)
                   if body is not None and renders_alike(body) else None)
            packed = None if ids is None else pack(ids)
            if packed is None:
                self.memory.forget(key)  # used once, matched or not
                return None
            prompt = template_tag(plan) + packed
        else:
            if body is not None and shifts_ids(body):
                self.memory.forget(key)
                return None
            prompt = template_tag(plan) + plan.data
        found = self.memory.take(key, prompt, now)
        if found is None:
            return None
        replica, params = found
        return params if self._refresh(replica) == "same" else None

    def _refresh(self, name: str) -> Literal["gone", "changed", "same"]:
        """Whether `name` is the replica its entries were made with, not restarted since;
        when it is not, those entries go and it is recorded as it is now."""
        replica = self.fleet.replicas.get(name)
        if replica is None:
            self.memory.forget_replica(name)
            self._seen.pop(name, None)
            return "gone"
        now_seen = (replica, self.router.restarts(name))
        seen = self._seen.get(name)
        if seen is not None and seen[0] is replica and seen[1] == now_seen[1]:
            return "same"
        self.memory.forget_replica(name)  # made before a restart or a replacement
        for gone in [n for n in self._seen if n not in self.fleet.replicas]:
            self.memory.forget_replica(gone)
            del self._seen[gone]
        self._seen[name] = now_seen
        return "changed"
