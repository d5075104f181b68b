"""Fixtures for the real-engine tests.

- `realengine_model` (session): path of the tiny seeded GGUF, generated once under
  `build/realengine/` (keyed by a hash of the generator spec) and reused across runs.
- `llama_options` (session): the `EngineOptions` of the shared pair below.
- `llama_pair` (module): base URLs of two llama.cpp replicas (separate processes, 3 slots,
  host prompt cache off) serving the model as "tiny".
- `fresh_llamas(count, **overrides)` (function): a factory starting replicas that only the
  calling test uses (for runs whose cache state must start empty); stopped after the test.

Every test in this folder is marked `realengine` and skipped, with the reason, only when
xllamacpp/gguf/tokenizers cannot be imported.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.realengine.engine import EngineOptions, engine_unavailable, llama_replicas
from tests.realengine.model import TINY, ensure_model
from tests.servers import ROOT

_HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselection sees the items
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = engine_unavailable()
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.realengine)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def realengine_model() -> Path:
    return ensure_model(TINY, ROOT / "build" / "realengine")


@pytest.fixture(scope="session")
def llama_options(realengine_model: Path) -> EngineOptions:
    return EngineOptions(model_path=realengine_model, slots=3, cache_ram_mib=0)


@pytest.fixture(scope="module")
def llama_pair(llama_options: EngineOptions) -> Iterator[list[str]]:
    with llama_replicas(llama_options, 2) as urls:
        yield urls


@pytest.fixture
def fresh_llamas(
    llama_options: EngineOptions,
) -> Iterator[Callable[..., list[str]]]:
    with contextlib.ExitStack() as stack:

        def start(count: int, **overrides: Any) -> list[str]:
            options = dataclasses.replace(llama_options, **overrides)
            return stack.enter_context(llama_replicas(options, count))

        yield start
