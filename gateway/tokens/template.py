"""A model's chat template, rendered the way vLLM renders it (Hugging Face's conventions).

vLLM applies the tokenizer's Jinja chat template with `messages`, `tools` (when given),
`add_generation_prompt=True` and the special tokens as variables, in a sandboxed
environment with `tojson` and `raise_exception`, trimming blocks. Rendering the same text
is what makes the gateway's tokens equal the replica's; the parity check (parity.py) proves
it per replica.

The template comes from the model's files: `chat_template.jinja`, else `chat_template` in
`tokenizer_config.json` (a string, or a list of named templates where `default` is used).
Loading reads files: call `load_template` off the event loop, once, at start-up.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


class TemplateError(ValueError):
    pass


class Template(Protocol):
    """What the renderer needs: the Jinja template below, or another renderer of the
    same prompt (the simulator's ChatML renderer, in its benchmarks)."""

    def render(self, messages: list[Any], tools: list[Any] | None = None,
               add_generation_prompt: bool = True) -> str: ...


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Hugging Face's filter: unlike Jinja's own, it does not HTML-escape.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise TemplateError(message)


_DICT_ATTRS = frozenset(dir(dict))


def _sandbox() -> type[Any]:
    """Jinja's immutable sandbox (what transformers and vLLM render chat templates in),
    with one shortcut that changes no result: `message.role` on a plain dict. The sandbox
    first tries the attribute, which for a key of a plain dict always raises
    AttributeError, and only then the item; a template touches such keys hundreds of times
    per conversation, and the raised exceptions were most of its rendering time. Names
    that are dict attributes (`items`, `get`, ...) keep the sandbox's own path."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Sandbox(ImmutableSandboxedEnvironment):
        def getattr(self, obj: Any, attribute: str) -> Any:
            if type(obj) is dict and attribute not in _DICT_ATTRS:
                try:
                    return obj[attribute]
                except (TypeError, LookupError):
                    return self.undefined(obj=obj, name=attribute)
            return super().getattr(obj, attribute)

    return Sandbox


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    source: str
    special: Mapping[str, str]  # bos_token, eos_token, ... as template variables
    _compiled: Any

    @classmethod
    def from_source(cls, source: str, special: Mapping[str, str] | None = None
                    ) -> ChatTemplate:
        env = _sandbox()(trim_blocks=True, lstrip_blocks=True,
                         extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        return cls(source, dict(special or {}), env.from_string(source))

    def render(self, messages: list[Any], tools: list[Any] | None = None,
               add_generation_prompt: bool = True, **kwargs: Any) -> str:
        try:
            return str(self._compiled.render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                **self.special, **kwargs))
        except TemplateError:
            raise
        except Exception as exc:  # a template's own type errors on odd input
            raise TemplateError(f"chat template failed: {exc}") from exc


def load_template(model_dir: str | Path) -> ChatTemplate:
    root = Path(model_dir)
    config: dict[str, Any] = {}
    config_path = root / "tokenizer_config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
    jinja = root / "chat_template.jinja"
    source: object = jinja.read_text(encoding="utf-8") if jinja.is_file() else config.get(
        "chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str):
        raise TemplateError(f"no chat template in {root}")
    special = {k: v for k, v in config.items()
               if k.endswith("_token") and isinstance(v, str)}
    return ChatTemplate.from_source(source, special)
