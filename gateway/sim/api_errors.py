"""Errors of the Responses and Messages routes whose `type` vLLM 0.32 names explicitly
(not by status, as gateway.sim.errors does): the response store's 404
(`invalid_request_error`) and request-model validation failures ("Bad Request", param
`body.<field>`, pydantic's message), which vLLM answers in its OpenAI shape on both APIs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.sim.errors import ApiError


class TypedError(ApiError):
    def __init__(self, status: int, message: str, param: str | None, kind: str) -> None:
        super().__init__(status, message, param)
        self.kind = kind

    @property
    def type(self) -> str:
        return self.kind


class ValidationError(TypedError):
    pass


def missing(field: str, body: Mapping[str, Any]) -> ValidationError:
    loc = f"body.{field}"
    return ValidationError(
        400, "1 validation error:\n  {'type': 'missing', 'loc': '" + loc + "', 'msg': 'Field "
        f"required', 'input': '<dict of {len(body)} items>'}}", loc, "Bad Request")
