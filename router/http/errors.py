"""Failures -> OpenAI's error body `{"error": {"message", "type", "param", "code"}}` and the
HTTP status a client of OpenAI's API expects (the gRPC status the same failure gets on the
gRPC front door, mapped)."""

from __future__ import annotations

import math

import grpc
from fastapi.responses import JSONResponse

# gRPC status -> (HTTP status, OpenAI error type)
_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


class ApiError(Exception):
    """A failure the API answers with OpenAI's error body."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.type = _STATUS.get(code, (500, "internal_error"))
        self.code = code.name.lower()
        self.param = param  # the request field at fault
        self.retry_after_s = retry_after_s  # 429: when to try again

    @classmethod
    def from_router(
        cls, code: grpc.StatusCode, message: str, trailing: tuple[tuple[str, str], ...]
    ) -> ApiError:
        """From a RouterError's status and trailing metadata (`epd-field`, `retry-after-ms`)."""
        meta = dict(trailing)
        retry = meta.get("retry-after-ms")
        field = meta.get("epd-field")  # a GenerateRequest field: sampling's are top-level here
        return cls(
            code,
            message,
            param=field.removeprefix("sampling.") if field else None,
            retry_after_s=int(retry) / 1000 if retry and retry.isdigit() else None,
        )

    def body(self) -> dict[str, dict[str, str | None]]:
        """OpenAI's error object."""
        return {
            "error": {
                "message": str(self),
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        """The HTTP answer (429 carries `Retry-After`, whole seconds rounded up)."""
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return JSONResponse(self.body(), status_code=self.status, headers=headers)
