"""Simulator parity: the cases of `tests/realvllm/parity.py` against `gateway sim` and a real
vLLM 0.32 replica started the same way (model name, max_model_len, 32-token blocks, tool
parser and dev mode on; and a second pair with both off). The observed differences must be
exactly the listed known ones; the table is written to build/realvllm/parity.md."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.realvllm.parity import KNOWN_DIFFERENCES, report, run_all
from tests.realvllm.vllm import MODEL_NAME, VllmOptions
from tests.servers import ROOT, sim

pytestmark = pytest.mark.realvllm


def _sim_flags(options: VllmOptions, tools_and_dev: bool) -> list[str]:
    flags = ["--model", options.served_name, "--max-model-len", str(options.max_model_len),
             "--block-size", str(options.block_size), "--speed", "1000"]  # fmt: skip
    if tools_and_dev:
        flags += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--dev-mode"]
    return flags


@pytest.fixture
def sims(vllm_options: VllmOptions) -> Iterator[tuple[str, str]]:
    with (
        sim(1, _sim_flags(vllm_options, True)) as on,
        sim(1, _sim_flags(vllm_options, False)) as off,
    ):
        yield on[0], off[0]


def test_simulator_matches_real_vllm_up_to_the_known_differences(
    sims: tuple[str, str], vllm_pair: list[str], fresh_vllm: Callable[..., list[str]]
) -> None:
    (plain,) = fresh_vllm(1, tool_parser=None, dev_mode=False)
    diffs = run_all(sims[0], vllm_pair[1], sims[1], plain, MODEL_NAME)
    out = ROOT / "build" / "realvllm" / "parity.md"
    out.write_text(report(diffs))
    unexpected = {name: sorted(set(found) - set(KNOWN_DIFFERENCES.get(name, {})))
                  for name, found in diffs.items()}  # fmt: skip
    stale = {name: sorted(set(known) - set(diffs.get(name, [])))
             for name, known in KNOWN_DIFFERENCES.items()}  # fmt: skip
    assert not any(unexpected.values()), f"new differences (see {out}): {unexpected}"
    assert not any(stale.values()), f"listed differences no longer seen: {stale}"
