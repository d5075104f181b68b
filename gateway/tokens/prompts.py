"""Rendered prompt text -> its token count and chained block hashes, resumed from the
longest prefix seen before.

The rendered text of a conversation's next request starts with its previous request's text.
Its UTF-8 bytes are keyed at fixed checkpoints (checkpoints.py); at each checkpoint the
cache keeps the tokenization up to the last piece cut at or before it (a cut follows a
special token, where Hugging Face tokenizers split before anything else, tokenize.py) and
the block hashes of those tokens. A request tokenizes only the text after the longest
checkpoint it shares (through the piece cache), hashes only the blocks after it, and copies
the earlier hashes; the ids of earlier blocks are neither kept nor copied, only the partial
block at each checkpoint. Splitting, piece lookups and hashing no longer scan the whole
conversation: what still does is rendering the template and one copy of the hash list.

The result equals tokenizing the whole text and chain-hashing all its ids (tested by
hypothesis against exactly that).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.checkpoints import Checkpoints, Run
from gateway.tokens.chain import chain_token_hashes
from gateway.tokens.tokenize import TokenizerCache


@dataclass(frozen=True, slots=True)
class _At:
    """A checkpoint's state: the text up to byte `cut` is `tokens` tokens, whose full
    blocks hash to `run.hashes[: tokens // block_size]` and whose partial last block is
    `partial` (fewer than block_size ids; all a resumed request needs of the ids)."""

    run: Run
    cut: int
    tokens: int
    partial: tuple[int, ...]


class PromptChains:
    # Defaults: at most 2^20 hashes referenced (16-32M tokens of prompts at vLLM's block
    # sizes) and 16,384 checkpoints, each with its partial block (under block_size ids).
    def __init__(self, tokenizer: TokenizerCache, block_size: int, stride: int = 2048,
                 budget_hashes: int = 1 << 20, max_entries: int = 16384) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size
        self._cp: Checkpoints[_At] = Checkpoints(stride, budget_hashes, max_entries)

    @property
    def held(self) -> int:
        """Hashes referenced by the checkpoints (each list counted once)."""
        return self._cp.held

    def encode(self, text: str, seed: int) -> tuple[int, list[int]]:
        """(token count, chained hashes of the full blocks from `seed`) of `text`."""
        data = text.encode("utf-8", "surrogatepass")
        cp, bs = self._cp, self.block_size
        keys = cp.keys(data, seed)
        j, at = cp.find(keys)
        if at is None:
            cut, count, hashes, open_ids = 0, 0, [], []
        else:
            cut, count = at.cut, at.tokens
            hashes = at.run.hashes[: count // bs]
            open_ids = list(at.partial)  # the ids after the last full block
        parent = hashes[-1] if hashes else seed
        first = len(hashes)  # full blocks before `open_ids`
        tail = data[cut:].decode("utf-8", "surrogatepass") if cut else text
        # Where each new piece ends (byte offset, tokens so far): the checkpoints' cuts.
        ends: list[tuple[int, int]] = [(cut, count)]
        end = cut
        pieces = self.tokenizer.pieces(tail)
        for piece, piece_ids in pieces:
            open_ids.extend(piece_ids)
            count += len(piece_ids)
            end += len(piece) if piece.isascii() else len(piece.encode("utf-8", "surrogatepass"))
            ends.append((end, count))
        if pieces and not self.tokenizer.ends_special(pieces[-1][0]):
            ends.pop()  # the text's end is no cut: what follows may tokenize with it
        hashes += chain_token_hashes(open_ids, parent, bs)
        run = cp.run_for(at.run if at is not None else None, j, hashes)
        stride, e = cp.stride, 0
        for k in range(j, len(keys)):
            limit = (k + 1) * stride
            while e + 1 < len(ends) and ends[e + 1][0] <= limit:
                e += 1
            at_cut, at_tokens = ends[e]
            full = at_tokens // bs
            partial = tuple(open_ids[(full - first) * bs : at_tokens - first * bs])
            cp.put(keys[k], _At(run, at_cut, at_tokens, partial), run)
        run.reach = max(run.reach, len(keys))
        return count, hashes
