"""OpenAI's error shape for the HTTP front: {"error": {message, type, param, code}}, with the
HTTP status the OpenAI SDKs map to their exceptions (HTTP_STATUS) and the retry-after headers
of a refusal that may be retried."""

from __future__ import annotations

import grpc
from starlette.responses import JSONResponse

from gateway.errors import InvalidArgument, QuotaExceeded, ResourceExhausted, status_of
from gateway.openai_schema import OpenAIRequest

# HTTP status and OpenAI error type of each status code the request path raises.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ABORTED: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.INTERNAL: (500, "internal_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
# A refusal at a gateway limit (not a tenant's quota, which says when) may be retried after
# this long; so may a 503 (no executor, Redis down).
OVERLOAD_RETRY_AFTER_MS = 1000


class BodyTooLarge(ResourceExhausted):
    """The request body is over the limit: 413."""


def error_json(message: str, kind: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(error: Exception, openai: OpenAIRequest | None = None) -> JSONResponse:
    """OpenAI's error object and HTTP status for an error of the request path.

    Raises:
        error itself, when it is none the request path maps (a bug: uvicorn logs it, 500).
    """
    status = status_of(error)
    if status is None:
        raise error
    code, message = status
    http_status, kind = HTTP_STATUS.get(code, (500, "internal_error"))
    param = None
    if isinstance(error, InvalidArgument):
        param = openai.error_param(error) if openai is not None else error.field
        if openai is not None and param != error.field:
            message = f"{param}: {str(error).partition(': ')[2]}"
    headers = {}
    if isinstance(error, BodyTooLarge):
        http_status = 413
    elif http_status in (429, 503):
        retry_ms = error.retry_after_ms if isinstance(error, QuotaExceeded) else None
        retry_ms = retry_ms if retry_ms is not None else OVERLOAD_RETRY_AFTER_MS
        headers = {"retry-after-ms": str(retry_ms), "retry-after": str(-(-retry_ms // 1000))}
    reason = getattr(error, "limit", None) or (code.name.lower() if param is None else None)
    body = error_json(message, kind, param, reason)
    return JSONResponse(body, status_code=http_status, headers=headers)


def internal_error_response(request_id: str) -> JSONResponse:
    """A 500 for an error the request path does not expect; its trace is in the log."""
    message = f"internal error in the gateway; its log has request {request_id}'s trace"
    return JSONResponse(error_json(message, "internal_error", None, "internal"), status_code=500)
