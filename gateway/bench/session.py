"""One agent session's conversation state (pure).

`AgentSession` turns a `SessionPlan` into chat request bodies turn by turn and keeps the
history consistent with what the endpoint really answered: the runner feeds every main
reply back with `reply()`, and the next turn's prompt is the previous prompt + that reply
+ the next tool result (unless the turn compacts the history). Sibling calls of a fan-out
turn share the main request's messages and add one final message each; their replies are
not fed back (they are side calls, as an agent's parallel sub-queries are).

With `hygiene_break` the system prompt starts with a timestamp that changes every turn, the
classic prefix-cache killer: nothing after it can be reused across turns.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from gateway.bench.workload import AgentPrompt, SessionPlan

# A fixed epoch keeps timestamps deterministic (no clock reads): turn time = epoch + plan time.
EPOCH = datetime.datetime(2025, 6, 2, 9, 0, 0, tzinfo=datetime.UTC)


@dataclass(frozen=True, kw_only=True)
class TurnRequest:
    session_id: str
    agent: str
    turn: int
    sibling: int  # 0 = the main request, k = k-th sibling
    body: dict[str, Any]


class AgentSession:
    def __init__(
        self, plan: SessionPlan, prompt: AgentPrompt, model: str, hygiene_break: bool = False
    ) -> None:
        self.plan = plan
        self.prompt = prompt
        self.model = model
        self.hygiene_break = hygiene_break
        self.history: list[dict[str, Any]] = [{"role": "user", "content": plan.task}]
        self._next = 0
        self._clock_s = plan.start_s

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
        if turn.tool_result:
            self.history.append({"role": "user", "content": turn.tool_result})
        if turn.compact and len(self.history) > 4:
            # Keep the task and the two newest messages; the middle becomes a summary.
            self.history = [
                self.history[0],
                {"role": "user", "content": turn.summary},
                *self.history[-2:],
            ]
        base = [{"role": "system", "content": self._system(turn.index)}, *self.history]
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
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "tools": list(self.prompt.tools),
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return TurnRequest(
            session_id=self.plan.session_id,
            agent=self.plan.agent,
            turn=turn,
            sibling=sibling,
            body=body,
        )

    def reply(self, text: str) -> None:
        """Feed back the main request's answer; advances to the next turn."""
        self.history.append({"role": "assistant", "content": text})
        self._next += 1

    @property
    def done(self) -> bool:
        return self._next >= len(self.plan.turns)

    @property
    def next_delay_s(self) -> float:
        return self.plan.turns[self._next].delay_s if not self.done else 0.0
