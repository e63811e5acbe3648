"""Errors as OpenAI's error JSON, and the map from the daemons' ERROR codes to HTTP statuses.

Body: `{"error": {"message", "type", "param", "code"}}`. A field that is wrong is named in `param`.
NO_CAPACITY is back-pressure (429 with Retry-After); a daemon that is down, draining or has lost
its link is 503 with Retry-After; a request that ran out of time is 504.
"""

from __future__ import annotations

from starlette.responses import Response

from api_server.sse import json_response
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
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    @property
    def outcome(self) -> str:
        """The metrics label of this failure."""
        return _OUTCOMES.get(self.status, "error")

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> Response:
        headers = {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return json_response(self.body(), status=self.status, headers=headers)


def bad_field(param: str, message: str) -> ApiError:
    """400 naming the field at fault."""
    return ApiError(400, message, param=param, code="invalid_value")


def from_daemon(code: ErrorCode, message: str, *, retry_after: int) -> ApiError:
    """The ApiError for a daemon's ERROR `code`."""
    status, kind = _STATUS.get(code, (500, "internal_error"))
    first = message.split(" ", 1)[0]
    param = first if code is ErrorCode.BAD_REQUEST and first in _FIELDS else None
    return ApiError(
        status,
        message,
        type=kind,
        param=param,
        code=code.value.lower(),
        retry_after=retry_after if status in (429, 503) else None,
    )


def unavailable(message: str, *, retry_after: int) -> ApiError:
    """503: the prefill daemon cannot be reached."""
    return ApiError(
        503, message, type="service_unavailable", code="unavailable", retry_after=retry_after
    )


def timed_out(seconds: float) -> ApiError:
    return ApiError(
        504,
        f"no answer from the daemons within {seconds:g} s (pdkv api start --request-timeout)",
        type="timeout",
        code="timeout",
    )
