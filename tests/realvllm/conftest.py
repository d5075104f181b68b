"""Fixtures for the real-vLLM tier (`-m realvllm`, excluded from the default run).

- `vllm_model` (session): the tiny random Qwen2 folder, written once under `build/realvllm/`.
- `vllm_options` (session): how the shared replicas run (32-token blocks, tools on, dev mode).
- `vllm_pair` (session): base URLs of two real vLLM CPU replicas serving it; started once
  for the whole tier (about a minute each, started side by side) and stopped by pid.
- `fresh_vllm(count, **overrides)` (function): replicas only the calling test uses.
- `vllm_pd` (module): a prefill/decode pair (`NixlConnector`, CPU buffer; tests/realvllm/pd.py)
  for the module that asks for it; skipped, with the reason, when NIXL does not import.

Every test in this folder is marked `realvllm` and skipped, with the reason, when vLLM's
interpreter (`GATEWAY_VLLM_PYTHON`, see tests/realvllm/install.sh) is absent or broken.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.realvllm.pd import PdPair, nixl_unavailable, pd_pair
from tests.realvllm.vllm import VllmOptions, ensure_model, vllm_replicas, vllm_unavailable
from tests.servers import ROOT

_HERE = Path(__file__).resolve().parent


@functools.cache
def _reason() -> str | None:
    return vllm_unavailable()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselection sees the items
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [i for i in items if _HERE in Path(str(i.fspath)).resolve().parents]
    for item in ours:
        item.add_marker(pytest.mark.realvllm)
    selected = config.getoption("markexpr", "") or ""
    if ours and "realvllm" in selected and "not realvllm" not in selected:
        reason = _reason()  # probing imports vLLM (seconds): only when the tier is asked for
        if reason:
            for item in ours:
                item.add_marker(pytest.mark.skip(reason=reason))


# Lines of each log a failing test's report shows
LOG_TAIL_LINES = 80


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failing test of this tier shows the tails of the engines' and gateways' logs
    written while it ran: CI's clean checkout is gone once the run ends, and a P/D hang
    (a CI run's decode leg timed out once, not reproduced alone) says why only there."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when != "call" or not report.failed:
        return
    if _HERE not in Path(str(item.fspath)).resolve().parents:
        return
    since = call.start - 1.0
    for log in sorted((ROOT / "build" / "realvllm" / "logs").glob("*.log")):
        if log.stat().st_mtime < since:
            continue
        lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        report.sections.append((f"log tail: {log.name}", "\n".join(lines)))


@pytest.fixture(scope="session")
def vllm_model() -> Path:
    reason = _reason()
    if reason:
        pytest.skip(reason)
    return ensure_model(ROOT / "build" / "realvllm")


@pytest.fixture(scope="session")
def vllm_options(vllm_model: Path) -> VllmOptions:
    return VllmOptions(model_path=vllm_model)


@pytest.fixture(scope="session")
def vllm_pair(vllm_options: VllmOptions) -> Iterator[list[str]]:
    with vllm_replicas(vllm_options, 2) as urls:
        yield urls


@pytest.fixture
def fresh_vllm(vllm_options: VllmOptions) -> Iterator[Callable[..., list[str]]]:
    with contextlib.ExitStack() as stack:

        def start(count: int, **overrides: Any) -> list[str]:
            options = dataclasses.replace(vllm_options, **overrides)
            return stack.enter_context(vllm_replicas(options, count))

        yield start


# NIXL's replicas compile and warm up longer than plain ones: 4-5 minutes each on a quiet
# 2-core machine, both at once; measured 245 s to 654 s under a load average of 12-22
# (five test runs sharing 2 cores). The bound leaves room for that and more.
PD_START_TIMEOUT_S = 1200.0


@pytest.fixture(scope="module")
def vllm_pd(vllm_options: VllmOptions) -> Iterator[PdPair]:
    reason = nixl_unavailable()
    if reason:
        pytest.skip(reason)
    with pd_pair(dataclasses.replace(vllm_options, start_timeout_s=PD_START_TIMEOUT_S)) as pair:
        yield pair
