"""Error answers: OpenAI-style bodies for bad requests, and one generic answer for server faults.

A 4xx says what was wrong with the request, in words the server chose. A 500 says nothing
about the fault itself: exception text, type names and paths can reveal the installation, and
an engine fault can carry figures of whatever else the engine was doing. It carries a
reference instead, logged with the traceback, so the operator can find the cause.
"""

from __future__ import annotations

import logging
import uuid

from fastapi.responses import JSONResponse

log = logging.getLogger("spirit.server")


class APIError(Exception):
    """An OpenAI-style error answer: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code, self.headers)

    def body(self) -> dict:
        """The "error" object alone, as a stream's error event carries it."""
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def internal_error(exc: BaseException, context: str) -> APIError:
    """Log `exc` with its traceback under a fresh reference; the 500 the client gets names only
    that reference. `context` says what the server was doing (a route, a job), for the log."""
    reference = uuid.uuid4().hex[:12]
    log.error("%s failed (reference %s)", context, reference, exc_info=exc)
    return APIError(500, f"internal server error (reference {reference}); the server's log has the details",
                    "server_error", code="internal_error")
