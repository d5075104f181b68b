"""A request body -> the token ids and block hashes the replica will compute for it.

Chat requests are rendered with the model's chat template (messages, tools, the generation
prompt) as vLLM renders them: string content as is, a list of text parts joined with a
newline; completions prompts are tokenized as sent (a list of token ids is taken as is).
The hashes are chained at the replica's block size in the namespace of the model, the LoRA
adapter (when the served name is an adapter) and the body's `cache_salt`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gateway.tokens.chain import chain_token_hashes, namespace
from gateway.tokens.prompts import PromptChains
from gateway.tokens.template import Template, TemplateError
from gateway.tokens.tokenize import TokenizerCache


@dataclass(frozen=True, slots=True)
class TokenPrompt:
    tokens: int  # the prompt's token count
    seed: int  # the namespace the chain starts from
    hashes: list[int]  # chained hashes of the full blocks
    block_size: int


def _content(value: object) -> object:
    if isinstance(value, list):
        texts = [p.get("text") for p in value if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) == len(value) and all(isinstance(t, str) for t in texts):
            return "\n".join(t for t in texts if isinstance(t, str))
    return value


def chat_messages(body: Mapping[str, Any]) -> list[Any]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise TemplateError("messages must be a non-empty list")
    out: list[Any] = []
    for m in messages:
        if not isinstance(m, dict):
            raise TemplateError("each message must be an object")
        if isinstance(m.get("content"), list):
            m = {**m, "content": _content(m["content"])}
        out.append(m)
    return out


class TokenRenderer:
    """One model's renderer: template + tokenizer cache + the replica's block size."""

    def __init__(self, model: str, template: Template | None, tokenizer: TokenizerCache,
                 block_size: int, lora: str | None = None) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.model = model
        self.template = template
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.lora = lora
        self._prompts = PromptChains(tokenizer, block_size)

    def _source(self, body: Mapping[str, Any], endpoint: Literal["chat", "completions"]
                ) -> str | list[int]:
        """The text to tokenize, or the prompt's own token ids."""
        if endpoint == "chat":
            if self.template is None:
                raise TemplateError(f"model {self.model!r} has no chat template")
            tools = body.get("tools")
            return self.template.render(
                chat_messages(body), tools if isinstance(tools, list) and tools else None,
                add_generation_prompt=bool(body.get("add_generation_prompt", True)))
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            return list(prompt)
        raise TemplateError("prompt must be a string or a list of token ids")

    def token_ids(self, body: Mapping[str, Any],
                  endpoint: Literal["chat", "completions"]) -> list[int]:
        """Every id of the prompt (the parity check; routing needs only `prompt`)."""
        got = self._source(body, endpoint)
        return self.tokenizer.encode(got) if isinstance(got, str) else got

    def seed(self, body: Mapping[str, Any]) -> int:
        salt = body.get("cache_salt")
        return namespace(self.model, self.lora, salt if isinstance(salt, str) else None)

    def prompt(self, body: Mapping[str, Any], endpoint: Literal["chat", "completions"]
               ) -> TokenPrompt:
        got = self._source(body, endpoint)
        seed = self.seed(body)
        if isinstance(got, str):
            tokens, hashes = self._prompts.encode(got, seed)
        else:
            tokens, hashes = len(got), chain_token_hashes(got, seed, self.block_size)
        return TokenPrompt(tokens, seed, hashes, self.block_size)
