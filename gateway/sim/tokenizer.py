"""Deterministic, reversible, download-free tokenizer that behaves roughly like a BPE.

Algorithm: one compiled regex splits text into pieces the way GPT-style pre-tokenizers do
(special tokens, a word with its leading space, digit runs, punctuation runs, whitespace that
leaves its last space to the following word), with bounded repetition so that long words are
cut into chunks of at most 6 ASCII letters. Each piece *is* its token: the id is the piece's
UTF-8 bytes read as a big-endian integer behind a 0x01 marker byte (so ``"\\x00"`` survives),
which makes ``decode(encode(s)) == s`` for every string without any vocabulary file. Every
piece is at most 7 bytes, so ids stay below 2**64. English prose comes out at roughly 4-4.5
characters per token, close to Qwen's or Llama's BPE.

The three ChatML special tokens get Qwen2.5's real ids (151643-151645), which no piece id can
collide with (2-byte pieces end at 0x01FFFF = 131071, 3-byte pieces start at 0x01000000).

Knobs: none; the piece grammar is the tokenizer. Encoding is memoised per instance (bounded)
because prompts repeat the same words.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_IDS: dict[str, int] = {ENDOFTEXT: 151643, IM_START: 151644, IM_END: 151645}
SPECIAL_TEXT: dict[int, str] = {v: k for k, v in SPECIAL_IDS.items()}
ENDOFTEXT_ID = SPECIAL_IDS[ENDOFTEXT]
IM_END_ID = SPECIAL_IDS[IM_END]

# Order matters only where alternatives overlap (words are tried first because they are
# the most frequent piece); whitespace leaves the last space before a
# non-space to that word (like `\s+(?!\S)` in tiktoken's pattern). Non-ASCII letters are
# taken two at a time so a piece never exceeds 7 UTF-8 bytes (1 space + 2 x 3 bytes).
# Punctuation runs stop before a special token so that `x.<|im_end|>` keeps the special.
_PIECE = re.compile(
    r" ?[A-Za-z]{1,6}"
    r"|<\|(?:im_start|im_end|endoftext)\|>"
    r"|[0-9]{1,3}"
    r"| ?[^\W\d_A-Za-z]{1,2}"
    r"| ?(?:(?!<\|(?:im_start|im_end|endoftext)\|>)[!-/:-@\[-`{-~]){1,3}"
    r"|[ \t]{1,7}(?!\S)|\n{1,7}|[ \t]{1,7}"
    r"|(?s:.)"
)
_MEMO_LIMIT = 200_000


class Tokenizer:
    """Text <-> token ids. Stateless apart from a bounded memo of piece ids."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = dict(SPECIAL_IDS)

    def encode(self, text: str) -> list[int]:
        pieces = _PIECE.findall(text)
        try:
            # Fast path: every piece seen before (the common case for prompts).
            return list(map(self._ids.__getitem__, pieces))
        except KeyError:
            pass
        ids = self._ids
        get = ids.get
        out: list[int] = []
        append = out.append
        for piece in pieces:
            tid = get(piece)
            if tid is None:
                tid = _piece_id(piece)
                if len(ids) < _MEMO_LIMIT:
                    ids[piece] = tid
            append(tid)
        return out

    def piece(self, token_id: int) -> str:
        """Text of one token (exact for every id this tokenizer produces)."""
        special = SPECIAL_TEXT.get(token_id)
        if special is not None:
            return special
        if token_id < 0x100:
            raise ValueError(f"token id {token_id} is out of vocabulary")
        raw = token_id.to_bytes((token_id.bit_length() + 7) // 8, "big")
        if raw[0] != 1:
            raise ValueError(f"token id {token_id} is out of vocabulary")
        return raw[1:].decode("utf-8", errors="replace")

    def decode(self, token_ids: Iterable[int], skip_special: bool = False) -> str:
        if skip_special:
            return "".join(self.piece(t) for t in token_ids if t not in SPECIAL_TEXT)
        return "".join(self.piece(t) for t in token_ids)

    def pieces(self, token_ids: Sequence[int]) -> list[str]:
        return [self.piece(t) for t in token_ids]


def _piece_id(piece: str) -> int:
    return int.from_bytes(b"\x01" + piece.encode("utf-8"), "big")
