"""Errors as OpenAI's error JSON, and the map from the daemons' ERROR codes to HTTP statuses.

Body: `{"error": {"message", "type", "param", "code"}}`; `param` names the request field at
fault and is left out when no field is. NO_CAPACITY is back-pressure (429 with Retry-After); a
daemon that is down, draining or has lost its link is 503 with Retry-After; a request that ran
out of time is 504. docs/operations.md's API error table lists every error this API returns.
"""

from __future__ import annotations

from starlette.responses import Response

from api_server.sse import json_response
from common.context_length import is_context_error
from common.protocol import ErrorCode

# code → (HTTP status, OpenAI error type); codes not listed are 500 internal errors.
_STATUS: dict[ErrorCode, tuple[int, str]] = {
    ErrorCode.BAD_REQUEST: (400, "invalid_request_error"),
    ErrorCode.NO_CAPACITY: (429, "rate_limit_exceeded"),
    ErrorCode.SHUTTING_DOWN: (503, "service_unavailable"),
    ErrorCode.LINK_LOST: (503, "service_unavailable"),
    ErrorCode.WAIT_TIMEOUT: (504, "timeout"),
}
# HTTP status → the `outcome` label of pdkv_api_requests_total.
_OUTCOMES = {
    400: "bad_request",
    401: "unauthorized",
    404: "bad_request",
    413: "bad_request",
    429: "no_capacity",
    503: "unavailable",
    504: "timeout",
}
# Fields a daemon's BAD_REQUEST message may start with (the message names the field first).
_FIELDS = frozenset({"prompt", "max_tokens", "temperature", "top_k", "top_p", "seed"})


class ApiError(Exception):
    """One failed HTTP request: its status, OpenAI error fields and extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        retry_after: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param or None  # a field name, or none at all: never ""
        self.code = code
        self.retry_after = retry_after
        self.headers = dict(headers or {})

    @property
    def outcome(self) -> str:
        """The metrics label of this failure."""
        return _OUTCOMES.get(self.status, "error")

    def body(self) -> dict:
        error = {"message": self.message, "type": self.type, "code": self.code}
        if self.param is not None:
            error["param"] = self.param
        return {"error": error}

    def response(self) -> Response:
        headers = dict(self.headers)
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return json_response(self.body(), status=self.status, headers=headers)


def bad_field(param: str | None, message: str, *, code: str = "invalid_value") -> ApiError:
    """400 naming the field at fault."""
    return ApiError(400, message, param=param, code=code)


def unsupported(param: str, message: str) -> ApiError:
    """400 for a field whose value would change the output in a way pdkv does not implement."""
    return ApiError(400, message, param=param, code="unsupported_parameter")


def context_exceeded(param: str, message: str) -> ApiError:
    """400: the prompt and the tokens asked for do not fit in the model's context."""
    return ApiError(400, message, param=param, code="context_length_exceeded")


def from_daemon(
    code: ErrorCode, message: str, *, retry_after: int, max_tokens_param: str = "max_tokens"
) -> ApiError:
    """The ApiError for a daemon's ERROR `code`; `max_tokens_param` is the request's name for
    the limit on generated tokens (a chat request may call it max_completion_tokens)."""
    status, kind = _STATUS.get(code, (500, "internal_error"))
    param = None
    if code is ErrorCode.BAD_REQUEST:
        first = message.split(" ", 1)[0]
        param = first if first in _FIELDS else None
        if first == "token" or message.startswith("the prompt"):
            param = "prompt"
        if param == "max_tokens":
            param = max_tokens_param
        if is_context_error(message):
            return context_exceeded(param or "prompt", message)
    return ApiError(
        status,
        message,
        type=kind,
        param=param,
        code=code.value.lower(),
        retry_after=retry_after if status in (429, 503) else None,
    )


def unavailable(message: str, *, retry_after: int, code: str = "unavailable") -> ApiError:
    """503: the daemons cannot serve now (not answering, the link down, another model)."""
    return ApiError(503, message, type="service_unavailable", code=code, retry_after=retry_after)


def timed_out(seconds: float) -> ApiError:
    return ApiError(
        504,
        f"no answer from the daemons within {seconds:g} s (pdkv api start --request-timeout)",
        type="timeout",
        code="timeout",
    )


def too_large(size: int, limit: int) -> ApiError:
    """413: a request body of `size` bytes, over `limit`."""
    return ApiError(
        413,
        f"the request body ({size} bytes) is over the limit of {limit} bytes "
        f"({limit / 2**20:g} MiB)",
        code="request_too_large",
    )


def model_not_found(model: str, served: str) -> ApiError:
    return ApiError(
        404,
        f"model {model!r} is not served here; GET /v1/models lists {served!r}",
        param="model",
        code="model_not_found",
    )
