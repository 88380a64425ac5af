"""Typed API errors: each knows its HTTP status, vLLM error type and gRPC code."""

from __future__ import annotations

from typing import Any

import grpc


class APIError(Exception):
    status: int = 500
    err_type: str = "InternalServerError"
    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, param: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after  # seconds: HTTP Retry-After, gRPC trailing metadata

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC's form of Retry-After: `grpc-retry-pushback-ms` (honoured by gRPC's
        retry policy) and `retry-after` in seconds."""
        if self.retry_after is None:
            return ()
        return (("grpc-retry-pushback-ms", str(self.retry_after * 1000)),
                ("retry-after", str(self.retry_after)))

    def body(self) -> dict[str, Any]:
        """vLLM's error shape."""
        return {"error": {"message": self.message, "type": self.err_type,
                          "param": self.param, "code": self.status}}


class InvalidRequest(APIError):
    status = 400
    err_type = "BadRequestError"
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class Unauthorized(APIError):
    status = 401
    err_type = "AuthenticationError"
    grpc_code = grpc.StatusCode.UNAUTHENTICATED


class Forbidden(APIError):
    status = 403
    err_type = "PermissionDeniedError"
    grpc_code = grpc.StatusCode.PERMISSION_DENIED


class ModelNotFound(APIError):
    status = 404
    err_type = "NotFoundError"
    grpc_code = grpc.StatusCode.NOT_FOUND


class Overloaded(APIError):
    status = 429
    err_type = "RateLimitError"
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ServiceUnavailable(APIError):
    status = 503
    err_type = "ServiceUnavailableError"
    grpc_code = grpc.StatusCode.UNAVAILABLE


class NoWorkerAvailable(ServiceUnavailable):
    """No routable worker for the request."""


class UpstreamTimeout(APIError):
    status = 504
    err_type = "TimeoutError"
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
