"""Rendered prompt text -> token ids, with a cache so a growing conversation costs only its
new turn.

Hugging Face tokenizers split the text on special (added) tokens before anything else, so
the text between two special tokens is tokenized on its own and the ids of a prompt are the
concatenation of its pieces' ids. A chat template ends every turn with a special token
(`<|im_end|>` for ChatML): cutting the rendered text right after each special token gives
pieces that are exact units, and a conversation's earlier turns are the same pieces every
time. Pieces are cached (text -> ids, a bounded LRU); a request tokenizes only the pieces
it has not seen, usually its last turn and the generation prompt.

The `tokenizers` package is imported lazily (the `kv` extra); loading a tokenizer reads a
file, so build `TokenizerCache.from_file` off the event loop, once.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path


class TokenizerCache:
    """`encode(text)` with prefix-piece caching. `encode_piece` is the raw tokenizer (one
    piece, no special tokens added); `specials` the added tokens' text."""

    def __init__(self, encode_piece: Callable[[str], list[int]], specials: Sequence[str],
                 max_pieces: int = 65536) -> None:
        self._encode_piece = encode_piece
        ordered = sorted({s for s in specials if s}, key=len, reverse=True)
        # Cut after each special token (longest first so one never splits another).
        self._cut = (re.compile("(?<=" + ")|(?<=".join(map(re.escape, ordered)) + ")")
                     if ordered and all(len(s) == len(ordered[0]) for s in ordered)
                     else None)
        self._specials = ordered
        self._ends = tuple(ordered)
        self._pieces: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._max = max(1, max_pieces)
        self.hits = 0
        self.misses = 0

    @classmethod
    def from_file(cls, path: str | Path, max_pieces: int = 65536) -> TokenizerCache:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
        specials = [t.content for t in tok.get_added_tokens_decoder().values() if t.special]

        fast = getattr(tok, "encode_batch_fast", None)  # tokenizers >= 0.21: no offsets

        def encode_piece(text: str) -> list[int]:
            if fast is not None:
                return list(fast([text], add_special_tokens=False)[0].ids)
            return list(tok.encode(text, add_special_tokens=False).ids)

        return cls(encode_piece, specials, max_pieces)

    def split(self, text: str) -> list[str]:
        """Pieces ending right after a special token (the last may end with none)."""
        if not self._specials:
            return [text] if text else []
        if self._cut is not None:
            return [p for p in self._cut.split(text) if p]
        # Special tokens of different lengths: lookbehind needs a fixed width.
        pieces: list[str] = []
        start = 0
        pattern = re.compile("|".join(map(re.escape, self._specials)))
        for m in pattern.finditer(text):
            pieces.append(text[start : m.end()])
            start = m.end()
        if start < len(text):
            pieces.append(text[start:])
        return pieces

    def ends_special(self, piece: str) -> bool:
        """Whether `piece` ends with a special token (a cut: what follows tokenizes alone)."""
        return piece.endswith(self._ends)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for _, got in self.pieces(text):
            ids.extend(got)
        return ids

    def pieces(self, text: str) -> list[tuple[str, tuple[int, ...]]]:
        """The text's pieces with their ids (cached ones looked up, new ones encoded)."""
        out: list[tuple[str, tuple[int, ...]]] = []
        cache = self._pieces
        for piece in self.split(text):
            got = cache.get(piece)
            if got is None:
                self.misses += 1
                got = cache[piece] = tuple(self._encode_piece(piece))
                if len(cache) > self._max:
                    cache.popitem(last=False)
            else:
                self.hits += 1
                cache.move_to_end(piece)
            out.append((piece, got))
        return out

    def __len__(self) -> int:
        return len(self._pieces)
