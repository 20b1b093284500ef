"""Errors at the HTTP edge and their OpenAI-style bodies.

Every error response, from every endpoint (and from the balancer), has the body

    {"error": {"message": "...", "type": "...", "param": "<field or null>", "code": "<code or null>"}}

so that the official ``openai`` client raises its usual exception types
(``BadRequestError`` for 400, ``AuthenticationError`` for 401, ``NotFoundError`` for 404,
``RateLimitError`` for 429) with the message and ``param`` intact.
"""
from __future__ import annotations

from typing import Any

import pydantic
from fastapi.responses import JSONResponse

from ..errors import InvalidRequestError, PromptTooLongError


class APIError(Exception):
    """An error with its HTTP status; raised by handlers, rendered by the app's exception handler."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class QueueFullError(Exception):
    """The admission queue holds ``max_queue`` waiting sequences; the caller should retry later."""


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def from_invalid_request(e: InvalidRequestError, param_names: dict[str, str] | None = None) -> APIError:
    """A :class:`fastgen.InvalidRequestError` as a 400, its ``param`` renamed to the HTTP field name."""
    param = e.param
    message = str(e)
    if param_names and param in param_names:
        field = param_names[param]
        if message.startswith(f"{param}:"):
            message = f"{field}:{message[len(param) + 1:]}"
        param = field
    code = "context_length_exceeded" if isinstance(e, PromptTooLongError) else None
    return APIError(400, message, param=param, code=code)


def renamed(e: APIError, names: dict[str, str]) -> APIError:
    """``e`` with its ``param`` renamed by ``names`` (a chat prompt's errors name ``messages``,
    but in ``/generate`` the field is ``prompts``), in the message's leading ``param:`` too."""
    new = names.get(e.param or "")
    if new is None:
        return e
    message = f"{new}:{e.message[len(e.param) + 1:]}" if e.message.startswith(f"{e.param}:") else e.message
    return APIError(e.status, message, type=e.type, param=new, code=e.code, headers=e.headers)


def from_validation_error(e: pydantic.ValidationError) -> APIError:
    """The first pydantic error as a 400 naming its field (``param`` is the top-level field)."""
    err = e.errors(include_url=False)[0]
    loc = [str(p) for p in err.get("loc", ())]
    if err.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {err.get('msg')}", code="invalid_json")
    if err.get("type") == "model_type" and not loc:
        return APIError(400, "the request body must be a JSON object", code="invalid_json")
    path = ".".join(loc)
    return APIError(400, f"{path}: {err.get('msg')}" if path else str(err.get("msg")),
                    param=loc[0] if loc else None)
