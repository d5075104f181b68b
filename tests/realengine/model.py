"""A tiny Llama-architecture GGUF with seeded random weights, for llama.cpp as a real engine.

Algorithm: generate seeded pseudo-words (`Words`), train a byte-level BPE tokenizer on a
seeded corpus of them (`tokenizers`, ~1 s), add ChatML specials (`<|endoftext|>`,
`<|im_start|>`, `<|im_end|>`), then write a GGUF (`gguf`) with `tokenizer.ggml.model = gpt2`,
the vocabulary, token types, merges, bos/eos ids, a ChatML chat template and f16 weights
drawn from `numpy.random.default_rng(seed)`. The output is gibberish, which is fine: the
gateway cares about tokens and cache, not text.

Knobs (`ModelSpec`): layers, dims, heads, ffn size, vocab size, context length, seed.
`ensure_model(spec, folder)` writes `folder/tiny-<hash>.gguf` once, keyed by a hash of the
spec and `GENERATOR_VERSION`, and reuses it afterwards (written to a temp name, then renamed,
so a concurrent or interrupted run never leaves a half file under the final name).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Bump when the bytes written for the same spec change, so cached files are regenerated.
GENERATOR_VERSION = 1

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_ID, IM_START_ID, EOS_ID = 0, 1, 2

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 4
    n_ff: int = 128
    n_vocab: int = 1024
    n_ctx_train: int = 8192
    seed: int = 1234
    corpus_words: int = 60_000

    def key(self) -> str:
        blob = json.dumps({"v": GENERATOR_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


TINY = ModelSpec()
MEDIUM = ModelSpec(n_layer=4, n_embd=256, n_head=8, n_head_kv=8, n_ff=512, n_vocab=2048)


class Words:
    """Seeded pseudo-words from a fixed lexicon; the tokenizer is trained on the same
    lexicon, so prompts built from it cost about one token per word."""

    def __init__(self, seed: int, lexicon_size: int = 2000) -> None:
        lex_rng = np.random.default_rng(7)  # the lexicon is fixed for every seed
        lexicon: list[str] = []
        for _ in range(lexicon_size):
            syllables = int(lex_rng.integers(1, 4))
            lexicon.append(
                "".join(
                    _CONSONANTS[int(lex_rng.integers(len(_CONSONANTS)))]
                    + _VOWELS[int(lex_rng.integers(len(_VOWELS)))]
                    for _ in range(syllables)
                )
            )
        self.lexicon = lexicon
        self.rng = np.random.default_rng(seed)

    def text(self, n_words: int) -> str:
        # Zipf-like pick so frequent words become single tokens after BPE training.
        idx = np.minimum(self.rng.zipf(1.3, size=n_words) - 1, len(self.lexicon) - 1)
        return " ".join(self.lexicon[int(i)] for i in idx)


def _train_tokenizer(spec: ModelSpec) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a byte-level BPE trained on seeded words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.n_vocab,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    words = Words(spec.seed)

    def corpus() -> Iterator[str]:
        for _ in range(spec.corpus_words // 50):
            yield words.text(50)

    tok.train_from_iterator(corpus(), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = [""] * len(vocab)
    for piece, i in vocab.items():
        tokens[i] = piece
    # llama.cpp: 1 = normal, 3 = control (never produced by parsing plain text).
    types = [3 if t in SPECIALS else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, types, merges


def _write_gguf(spec: ModelSpec, path: Path) -> None:
    import gguf

    tokens, types, merges = _train_tokenizer(spec)
    n_vocab = len(tokens)
    head_dim = spec.n_embd // spec.n_head
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("gateway-tiny-random")
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_eot_token_id(EOS_ID)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)

    rng = np.random.default_rng(spec.seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        # numpy shape is (rows, cols) = ggml ne [cols, rows]; small std keeps activations sane.
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float16)

    kv_dim = head_dim * spec.n_head_kv
    w.add_tensor("token_embd.weight", mat(n_vocab, spec.n_embd))
    w.add_tensor("output_norm.weight", np.ones(spec.n_embd, dtype=np.float32))
    w.add_tensor("output.weight", mat(n_vocab, spec.n_embd))
    for i in range(spec.n_layer):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(spec.n_embd, dtype=np.float32))
        w.add_tensor(b + "attn_q.weight", mat(spec.n_embd, spec.n_embd))
        w.add_tensor(b + "attn_k.weight", mat(kv_dim, spec.n_embd))
        w.add_tensor(b + "attn_v.weight", mat(kv_dim, spec.n_embd))
        w.add_tensor(b + "attn_output.weight", mat(spec.n_embd, spec.n_embd))
        w.add_tensor(b + "ffn_norm.weight", np.ones(spec.n_embd, dtype=np.float32))
        w.add_tensor(b + "ffn_gate.weight", mat(spec.n_ff, spec.n_embd))
        w.add_tensor(b + "ffn_up.weight", mat(spec.n_ff, spec.n_embd))
        w.add_tensor(b + "ffn_down.weight", mat(spec.n_embd, spec.n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def ensure_model(spec: ModelSpec, folder: Path) -> Path:
    """Path of the GGUF for `spec` under `folder`, generating it on first use."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"realengine-{spec.key()}.gguf"
    if path.exists():
        return path
    tmp = folder / f".{path.name}.{os.getpid()}.tmp"
    try:
        _write_gguf(spec, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
