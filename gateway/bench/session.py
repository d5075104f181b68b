"""One agent session's conversation state (pure).

`AgentSession` turns a `SessionPlan` into chat request bodies turn by turn and keeps the
history consistent with what the endpoint really answered: the runner feeds every main
reply back with `reply()`, and the next turn's prompt is the previous prompt + that reply
+ the next tool result (unless the turn compacts the history). Sibling calls of a fan-out
turn share the main request's messages and add one final message each; their replies are
not fed back (they are side calls, as an agent's parallel sub-queries are).

Against a real server (see `gateway.bench.server`) two limits apply: `tool_choice` is
added to every body when the server needs it, and `max_model_len` bounds the prompt: when
the next turn's prompt plus its `max_tokens` would not fit, the session compacts its history
first (task, a summary, the newest exchange), as an agent does at its context limit, and
cuts the newest tool result if even that is too long. Prompt size is estimated from the
characters per token that the endpoint's own usage reported on the previous turn.

With `tool_calls` every request asks for a tool call (`tool_choice: "required"`) and the
answer's calls go back into the history as an assistant message with `tool_calls`; the next
turn answers each call with a `role: tool` message (the first carries the turn's tool
result, the others a short output), as an agent loop does. Such a turn's `max_tokens` is at
least `TOOL_CALL_MIN_TOKENS`, room for a call's arguments. A call cut short (arguments that
do not parse) is not sent back as a call: a server answers 400 to one. An answer without
whole calls (a server without tool calling) is fed back as text, and the tool result as a
user message.

With `hygiene_break` the system prompt starts with a timestamp that changes every turn, the
classic prefix-cache killer: nothing after it can be reused across turns.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from typing import Any

from gateway.bench.workload import AgentPrompt, SessionPlan, Workload

# A fixed epoch keeps timestamps deterministic (no clock reads): turn time = epoch + plan time.
EPOCH = datetime.datetime(2025, 6, 2, 9, 0, 0, tzinfo=datetime.UTC)


@dataclass(frozen=True, kw_only=True)
class TurnRequest:
    session_id: str
    agent: str
    turn: int
    sibling: int  # 0 = the main request, k = k-th sibling
    body: dict[str, Any]


TOOL_OK = '{"status": "ok"}'  # the output of a call beyond a turn's first
TOOL_CALL_MIN_TOKENS = 128  # a call's name and arguments fit (the workload's tools: ~40)

# Before any usage is seen: fewer characters per token than English text averages, so the
# first estimate errs towards compacting early rather than a 400.
INITIAL_CHARS_PER_TOKEN = 2.5
CONTEXT_MARGIN = 0.95  # estimates are estimates: keep 5% of the context free


@dataclass(frozen=True, kw_only=True)
class ServerLimits:
    max_model_len: int | None = None
    tool_choice: str | None = None
    chars_per_token: float | None = None  # measured by the probe; else INITIAL_...


class AgentSession:
    def __init__(
        self, plan: SessionPlan, prompt: AgentPrompt, model: str, hygiene_break: bool = False,
        limits: ServerLimits | None = None, tool_calls: bool = False,
    ) -> None:
        self.plan = plan
        self.prompt = prompt
        self.model = model
        self.hygiene_break = hygiene_break
        self.limits = limits or ServerLimits()
        self.history: list[dict[str, Any]] = [{"role": "user", "content": plan.task}]
        self._next = 0
        self._clock_s = plan.start_s
        self._chars_per_token = self.limits.chars_per_token or INITIAL_CHARS_PER_TOKEN
        self._last_chars = 0
        self.tool_calls = tool_calls
        self._open_calls: list[dict[str, Any]] = []  # the last answer's, to be answered

    def _system(self, turn: int) -> str:
        if not self.hygiene_break:
            return self.prompt.system
        # Seconds resolution plus the turn number: always different between turns.
        stamp = EPOCH + datetime.timedelta(seconds=self._clock_s + turn)
        return f"Current time: {stamp.isoformat(timespec='seconds')}\n" + self.prompt.system

    def requests(self) -> list[TurnRequest]:
        """The bodies of the next turn: the main request first, then its siblings."""
        turn = self.plan.turns[self._next]
        self._clock_s += turn.delay_s
        calls, self._open_calls = self._open_calls, []
        for i, call in enumerate(calls):
            output = turn.tool_result if i == 0 and turn.tool_result else TOOL_OK
            self.history.append({"role": "tool", "tool_call_id": call["id"], "content": output})
        if turn.tool_result and not calls:
            self.history.append({"role": "user", "content": turn.tool_result})
        if turn.compact and len(self.history) > 4:
            # Keep the task and the two newest messages; the middle becomes a summary.
            self.history = [
                self.history[0],
                {"role": "user", "content": turn.summary},
                *self.history[-2:],
            ]
        base = [{"role": "system", "content": self._system(turn.index)}, *self.history]
        if self._too_long(base, turn.max_tokens):
            base = self._fit(base, turn.summary, turn.max_tokens)
        self._last_chars = self._prompt_chars(base)
        out = [self._request(turn.index, 0, base, turn.max_tokens)]
        for k, text in enumerate(turn.siblings, start=1):
            out.append(
                self._request(
                    turn.index, k, [*base, {"role": "user", "content": text}], turn.max_tokens
                )
            )
        return out

    def _request(
        self, turn: int, sibling: int, messages: list[dict[str, Any]], max_tokens: int
    ) -> TurnRequest:
        if self.tool_calls:
            max_tokens = max(max_tokens, TOOL_CALL_MIN_TOKENS)
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "tools": list(self.prompt.tools),
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.tool_calls:
            body["tool_choice"] = "required"
        elif self.limits.tool_choice is not None:
            body["tool_choice"] = self.limits.tool_choice
        return TurnRequest(
            session_id=self.plan.session_id,
            agent=self.plan.agent,
            turn=turn,
            sibling=sibling,
            body=body,
        )

    def reply(self, text: str, prompt_tokens: int | None = None,
              tool_calls: list[dict[str, Any]] | None = None) -> None:
        """Feed back the main request's answer (and the prompt tokens its usage reported,
        and its tool calls, answered on the next turn); advances to the next turn."""
        if prompt_tokens and self._last_chars:
            self._chars_per_token = self._last_chars / prompt_tokens
        whole = [c for c in tool_calls or () if _parses(c)]
        if whole:
            self.history.append({"role": "assistant", "content": text or None,
                                 "tool_calls": whole})
            self._open_calls = whole
        else:
            self.history.append({"role": "assistant", "content": text})
        self._next += 1

    def _prompt_chars(self, messages: list[dict[str, Any]]) -> int:
        # Counted as `gateway.bench.server.prompt_chars` counts (tools are rendered too).
        return _chars(messages) + len(str(list(self.prompt.tools)))

    def _tokens(self, messages: list[dict[str, Any]]) -> int:
        return int(self._prompt_chars(messages) / self._chars_per_token)

    def _too_long(self, messages: list[dict[str, Any]], max_tokens: int) -> bool:
        limit = self.limits.max_model_len
        return limit is not None and self._tokens(messages) + max_tokens > limit * CONTEXT_MARGIN

    def _fit(
        self, base: list[dict[str, Any]], summary: str, max_tokens: int
    ) -> list[dict[str, Any]]:
        system, task, *rest = base
        self.history = [task, {"role": "user", "content": summary}, *rest[-2:]]
        fitted = [system, *self.history]
        while self._too_long(fitted, max_tokens) and len(str(fitted[-1]["content"])) > 64:
            last = fitted[-1]
            # Halve the newest message (a tool result as a rule) until the prompt fits.
            content = str(last["content"])
            fitted[-1] = {**last, "content": content[: len(content) // 2]}
            self.history[-1] = fitted[-1]
        return fitted

    @property
    def done(self) -> bool:
        return self._next >= len(self.plan.turns)

    @property
    def next_delay_s(self) -> float:
        return self.plan.turns[self._next].delay_s if not self.done else 0.0


def _parses(call: dict[str, Any]) -> bool:
    """A whole call: a name, and arguments that are a JSON object."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not fn.get("name"):
        return False
    try:
        return isinstance(json.loads(str(fn.get("arguments") or "")), dict)
    except ValueError:
        return False


def _chars(messages: list[dict[str, Any]]) -> int:
    return sum(len(str(m.get("content") or "")) + len(str(m.get("tool_calls") or ""))
               for m in messages)


def sample_body(workload: Workload) -> dict[str, Any] | None:
    """The first session's first request: what the probe tokenizes to learn the ratio."""
    if not workload.sessions:
        return None
    plan = workload.sessions[0]
    return AgentSession(plan, workload.prompts[plan.agent], "sample").requests()[0].body
