"""What a prefill leg's own answer says of P's cache (pure): the tokens P found cached,
those it pulled back from the decoder (`[pd] reuse_decoder_kv`), and what of P's
prediction that report can judge.

P's answer reports `usage.prompt_tokens_details.cached_tokens` = P's local prefix-cache
hits + the tokens it loaded from elsewhere, summed (vLLM 0.32's scheduler; the same count
goes to D as `remote_prefill_cached_tokens`). A fresh prefill leg loads nothing: the
report is P's own hits, exactly. A leg sent with the decoder's params of the last turn may
pull: vLLM's NIXL scheduler (pull_scheduler.py) pulls

    count = min(remote_num_tokens, prompt_tokens) - local hits,  only if count >= threshold

(`kv_recompute_threshold`, 64 by default), so the report is then min(remote_num_tokens,
prompt_tokens) (the "pull level"; `remote_num_tokens` is in the params the gateway sent),
and without a pull it is the local hits. Hence:

- a report above the pull level, or more than one engine block below it (room for an
  engine that trims the last block), cannot include a pull: nothing was pulled (exact),
  and the report judges P's prediction as a one-leg answer does;
- a report at the pull level may or may not include one: P's local hits lie anywhere from
  0 to the report, so only "under" (the report, local hits and all, well below the
  prediction) is judged; "ok" and "over" are not told apart from a pull. The tokens
  pulled are then estimated from P's prediction (what the index says P held): the report
  less the prediction when that leaves at least `threshold` to pull, else 0. Not exact
  per request: the engine's own split is its `vllm:prompt_tokens_by_source` counters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gateway.routing.feedback import Verdict, verdict

Judge = Literal["full", "under_only"]


def reported_cached(usage_cached: int | None, params: Mapping[str, Any]) -> int | None:
    """P's report of its cached tokens: its usage's, else the count its answer's
    `kv_transfer_params` carry for D (`remote_prefill_cached_tokens`, the same figure,
    set by vLLM's scheduler whether or not the engine runs
    `--enable-prompt-tokens-details`); None when neither says (a count left unknown, never
    taken from D's copy, which on a turn that pulled would count pulled tokens as hits)."""
    if usage_cached is not None:
        return usage_cached
    value = params.get("remote_prefill_cached_tokens")
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


@dataclass(frozen=True, slots=True)
class PrefillReport:
    cached: int  # P's reported cached tokens: its own hits + any pulled
    pulled: int  # of those, pulled back from the decoder (0: none)
    exact: bool  # `pulled` follows from the report (True) or is estimated (False)
    judge: Judge  # what of P's prediction the report can judge


def pull_level(sent: int | None, prompt_tokens: int | None) -> int | None:
    """What a pull brings P's cached count to: min(remote_num_tokens, prompt); None when
    no decoder params were sent (`sent` None) or the prompt's size is unknown."""
    if sent is None or prompt_tokens is None:
        return None
    return min(sent, prompt_tokens)


def read_prefill(reported: int, predicted: int | None, *, sent: bool, level: int | None,
                 engine_block: int, threshold: int) -> PrefillReport:
    """P's report split (module docstring). `sent`: the leg carried the decoder's params;
    `level`: their pull_level, None when unknown (then any report may include a pull)."""
    if not sent or (level is not None
                    and (reported > level or reported < level - engine_block)):
        return PrefillReport(reported, 0, True, "full")
    # a pull would have brought the report to the pull level: what P held itself is the
    # report less what was pulled, at least `threshold` when there was a pull
    local = min(predicted or 0, reported)
    pulled = reported - local if reported - local >= threshold else 0
    return PrefillReport(reported, pulled, False, "under_only")


def prefill_verdict(report: PrefillReport, predicted: int, engine_block: int,
                    ) -> Verdict | None:
    """The feedback verdict on P's prediction, None when the report cannot tell it."""
    outcome = verdict(predicted, report.cached, engine_block)
    if report.judge == "full" or outcome == "under":
        return outcome
    return None
