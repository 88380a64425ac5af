"""Typed API errors: each knows its HTTP status, vLLM error type and gRPC code."""

from __future__ import annotations

from typing import Any

import grpc


class APIError(Exception):
    status: int = 500
    err_type: str = "InternalServerError"
    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

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


class NoWorkerAvailable(APIError):
    status = 503
    err_type = "ServiceUnavailableError"
    grpc_code = grpc.StatusCode.UNAVAILABLE


class UpstreamTimeout(APIError):
    status = 504
    err_type = "TimeoutError"
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
