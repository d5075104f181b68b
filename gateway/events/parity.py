"""Parity self-check: does the gateway tokenize and hash a probe request as the replica
does? Pure: the caller fetches the replica's `/tokenize` answer for the probe and the
first `BlockStored` event it caused, and passes them in.

A mismatch is reported with its likely cause:
- `block_size`: the event's block size is not the one the gateway hashes at;
- `template`: the replica's tokens decode (with the gateway's tokenizer) to other text
  than the gateway rendered: the chat template differs (tools, default system prompt,
  generation prompt, a newer template in the model's files);
- `tokenizer`: same text, other ids: the tokenizer differs (vocabulary, normalizer,
  special tokens, a BOS the replica adds);
- `length`: the first `count` tokens agree but one side has more (typically a BOS/EOS
  or generation prompt appended by one side only).
Token mode is only as good as this check: with a mismatch every overlap is silently zero.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from gateway.events.decode import BlockStored

Cause = Literal["template", "tokenizer", "block_size", "length"]


@dataclass(frozen=True, slots=True)
class Parity:
    ok: bool
    cause: Cause | None
    message: str
    first_difference: int | None = None  # token position


def _diff(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _tokens(rendered: str, ours: Sequence[int], theirs: Sequence[int],
            decode: Callable[[Sequence[int]], str] | None, what: str) -> Parity | None:
    at = _diff(ours, theirs)
    if at is None:
        return None
    if at == min(len(ours), len(theirs)):
        return Parity(False, "length", f"{what}: {len(theirs)} tokens at the replica, "
                      f"{len(ours)} here; the first {at} agree", at)
    if decode is not None and decode(theirs) != rendered[: len(decode(theirs))]:
        return Parity(False, "template", f"{what}: the replica's prompt text differs from "
                      f"the rendered template at token {at}", at)
    return Parity(False, "tokenizer", f"{what}: same text, other token ids from token {at} "
                  "(another vocabulary, pre-tokenizer or normalizer: transformers >= 5 "
                  "rebuilds some tokenizer classes' pre-tokenizers, Qwen2's among them, "
                  "whatever tokenizer.json says)", at)


def check(rendered: str, ours: Sequence[int], block_size: int,
          replica_tokens: Sequence[int] | None, first_event: BlockStored | None,
          decode: Callable[[Sequence[int]], str] | None = None) -> Parity:
    """Compare the gateway's rendering (`rendered`, its ids `ours`) with the replica's
    `/tokenize` ids and the tokens of the first event the probe caused (either may be
    None when unavailable)."""
    if replica_tokens is not None:
        found = _tokens(rendered, ours, replica_tokens, decode, "/tokenize")
        if found is not None:
            return found
    if first_event is not None:
        if first_event.block_size != block_size:
            return Parity(False, "block_size", f"the replica's blocks hold "
                          f"{first_event.block_size} tokens, the gateway hashes "
                          f"{block_size}")
        stored = first_event.token_ids
        found = _tokens(rendered, ours[: len(stored)], stored, decode, "first event")
        if found is not None:
            return found
    if replica_tokens is None and first_event is None:
        return Parity(False, None, "nothing to compare with (no /tokenize, no event)")
    return Parity(True, None, f"{len(ours)} tokens agree")
