"""Canonical bytes -> prompt tokens, learned from what the engine reports.

Two sources, combined:
- a per-model EWMA of bytes/token from (canonical bytes, prompt_tokens) of completed
  requests (weight `ratio_ewma_alpha`, start `initial_bytes_per_token`);
- anchors: when a request completes with T prompt tokens, its last full block's hash gets
  the token position where that block ends (T minus the estimated tail), plus the hash of
  the tail and T itself. A later request whose chain contains that block (the next turn of
  a conversation, or the same prompt again) is then estimated from the anchor plus the few
  bytes after it divided by the ratio, so the error does not grow with prompt length. If
  the later request also repeats the tail bytes, the earlier prompt is an exact prefix of
  it and its full length `reach` is known to be shared, plus the earlier answer's tokens
  when this request repeats it (vLLM caches generated tokens too; see `_reply_credit`).

Anchors live in one LRU keyed by block hash (the hash already covers model and salt):
token positions are a property of the content, not of the replica.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.routing.blocks import tail_hash
from gateway.routing.marks import Gates
from gateway.routing.normalize import END, START

END_MARK = END[0].encode()  # end of a message in the canonical stream
GENERATION_PROMPT = (START + "assistant\n").encode()


@dataclass(frozen=True, slots=True)
class Anchor:
    tokens: float  # tokens covering the chain up to the end of this block
    tail_hash: int  # hash of the bytes that followed this block, up to `tail_len`
    tail_len: int
    reach: float  # tokens shared by any request that repeats the tail too
    generated: int | None = None  # completion tokens of that request, when reported
    answer_follows: bool = False  # it ended with the generation prompt: its answer is next


class TokenEstimator:
    def __init__(
        self, initial_ratio: float, alpha: float, anchor_capacity: int, block_bytes: int
    ) -> None:
        self._initial = initial_ratio
        self._alpha = alpha
        self._ratios: dict[str, float] = {}
        self._anchors: OrderedDict[int, Anchor] = OrderedDict()
        self._gates = Gates()  # the anchors' windows: a search skips the rest (marks.py)
        self._capacity = max(1, anchor_capacity)
        self._block = block_bytes
        # The last search: (hashes, their length, anchors version, searched up to, found j).
        # One decision asks for the same chain several times (its whole length, then each
        # replica's match); with no anchor in (j, searched], any upto in [j, searched]
        # has the same answer, so the chain is scanned once per decision, not per replica.
        self._version = 0
        self._last: tuple[Sequence[int], int, int, int, int] | None = None

    def ratio(self, model: str) -> float:
        return self._ratios.get(model, self._initial)

    def mean_ratio(self) -> float:
        """Bytes/token over all models seen (sizes the index in blocks)."""
        ratios = self._ratios
        return sum(ratios.values()) / len(ratios) if ratios else self._initial

    def observe(self, model: str, nbytes: int, tokens: int) -> None:
        if tokens <= 0 or nbytes <= 0:
            return
        sample = nbytes / tokens
        old = self._ratios.get(model)
        self._ratios[model] = sample if old is None else old + self._alpha * (sample - old)

    def deepest(self, hashes: Sequence[int], upto: int) -> tuple[int, Anchor | None]:
        """(j, anchor) for the deepest anchored block among hashes[:upto]; j = blocks covered."""
        anchors = self._anchors
        if not anchors or upto <= 0:
            return 0, None
        upto = min(upto, len(hashes))
        last = self._last
        if (last is not None and last[0] is hashes and last[1] == len(hashes)
                and last[2] == self._version and last[4] <= upto <= last[3]):
            j = last[4]
        else:
            j = self._gates.deepest(hashes, upto, anchors)
            self._last = (hashes, len(hashes), self._version, upto, j)
        return (j, anchors[hashes[j - 1]]) if j else (0, None)

    def tokens_at(
        self, hashes: Sequence[int], blocks: int, ratio: float
    ) -> tuple[float, int, Anchor | None]:
        """Estimated tokens covering the first `blocks` blocks, with the anchor used."""
        j, anchor = self.deepest(hashes, blocks)
        base = anchor.tokens if anchor is not None else 0.0
        return base + (blocks - j) * self._block / ratio, j, anchor

    def prompt_tokens(self, hashes: Sequence[int], nbytes: int, ratio: float) -> float:
        j, anchor = self.deepest(hashes, len(hashes))
        if anchor is None:
            return nbytes / ratio
        return anchor.tokens + (nbytes - j * self._block) / ratio

    def matched_tokens(
        self, data: bytes, hashes: Sequence[int], blocks: int, ratio: float,
        answers: bool = True,
    ) -> float:
        """Tokens of this request a holder of hashes[:blocks] shares with it. `answers`:
        whether that holder generated the earlier answers it holds the prompts of (a P/D
        prefill replica computes prompts only: the reply credit is not its)."""
        if blocks <= 0:
            return 0.0
        est, j, anchor = self.tokens_at(hashes, blocks, ratio)
        if anchor is not None and j == blocks and anchor.tail_len > 0:
            end = blocks * self._block + anchor.tail_len
            if end <= len(data) and tail_hash(
                data[: end], blocks, self._block, hashes[blocks - 1]
            ) == anchor.tail_hash:
                credit = self._reply_credit(data, end, anchor, ratio) if answers else 0.0
                return max(est, anchor.reach + credit)
        if blocks < len(hashes):
            # The two streams part somewhere inside the next block: on average half-way.
            est += self._block / (2 * ratio)
        return est

    @staticmethod
    def _reply_credit(data: bytes, end: int, anchor: Anchor, ratio: float) -> float:
        """Tokens of the earlier request's answer that this request repeats.

        vLLM caches the blocks its generated tokens fill (all but the last token's KV), and
        the next turn of a conversation renders that answer right after the earlier
        prompt, up to the end-of-message marker. Credit the answer's text: its length here
        in bytes / ratio, or exactly completion_tokens - 1 (the stop token's KV is never
        computed) when the usage reported it.
        """
        if not anchor.answer_follows:
            return 0.0
        stop = data.find(END_MARK, end)
        if stop <= end:
            return 0.0
        estimate = (stop - end) / ratio
        if anchor.generated is not None:
            return float(min(max(0, anchor.generated - 1), estimate * 1.5 + 1))
        return estimate

    def set_anchor(
        self, data: bytes, hashes: Sequence[int], tokens_total: float, ratio: float,
        generated: int | None = None,
    ) -> None:
        """`data` (chained as `hashes`) is `tokens_total` tokens long: remember where its
        last full block ends in tokens."""
        n = len(hashes)
        if n == 0 or tokens_total <= 0:
            return
        tail_len = len(data) - n * self._block
        anchor = Anchor(
            tokens=max(0.0, tokens_total - tail_len / ratio),
            tail_hash=tail_hash(data, n, self._block, hashes[n - 1]),
            tail_len=tail_len,
            reach=tokens_total,
            generated=generated,
            answer_follows=data.endswith(GENERATION_PROMPT),
        )
        anchors = self._anchors
        self._version += 1
        anchors[hashes[n - 1]] = anchor
        anchors.move_to_end(hashes[n - 1])
        gates = self._gates
        if n > gates.head:  # (a mark in the head is counted nowhere: marks.py)
            gates.add(hashes[n - 1], hashes, n - 1)
        while len(anchors) > self._capacity:
            gone = anchors.popitem(last=False)[0]
            if gates.gate_of:
                gates.remove(gone)

    def bytes_for_tokens(
        self, hashes: Sequence[int], blocks: int, tokens: float, ratio: float
    ) -> float:
        """Byte position of `tokens` along the chain, using the deepest anchor below it."""
        j, anchor = self.deepest(hashes, blocks)
        while anchor is not None and anchor.tokens > tokens and j > 0:
            j, anchor = self.deepest(hashes, j - 1)
        if anchor is None:
            return tokens * ratio
        return j * self._block + (tokens - anchor.tokens) * ratio
