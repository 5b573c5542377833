"""What every front-end (gRPC, edge Collaborate, OpenAI HTTP) hands the router's one request path, and what
it gets back when the path refuses a request.

A front-end turns its wire format into a ``calid.v1.GenerateRequest`` and its credentials into a
``Caller``; the router validates, checks limits and keys, admits and streams back, and refuses by raising
``Refused`` with a gRPC status code. The front-end only translates that code (HTTP: serve_app.ingress.openai_wire).
"""
from __future__ import annotations

from dataclasses import dataclass

import grpc

from serve_app.ingress.auth import bearer

FRONTENDS = ("grpc", "edge", "http")
FORWARDED = ("Generate", "ListModels", "Health", "Cancel")  # unary methods a multi-model front forwards


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the API key it presented (None: none) and the front-end it came through."""

    key: str | None = None
    frontend: str = "grpc"


class Refused(Exception):
    """The request path refused a request (or ended it): a status code and a message meant for the caller.
    ``retry_after_s``: when retrying makes sense (a full queue), how long to wait first."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.code, self.message, self.retry_after_s = code, message, retry_after_s


def grpc_caller(grpc_context, frontend: str = "grpc") -> Caller:
    metadata = grpc_context.invocation_metadata() if grpc_context is not None else ()
    return Caller(bearer(metadata), frontend)


def set_grpc_status(grpc_context, refused: Refused) -> None:
    if grpc_context is not None:
        grpc_context.set_code(refused.code)
        grpc_context.set_details(refused.message)


class ForwardedContext:
    """Stands in for the gRPC context of a call a multi-model front forwarded to a model's router: the
    caller's metadata in, the status the router set out (the front sets it on the real context)."""

    def __init__(self, metadata: tuple = ()):
        self._metadata = tuple(metadata)
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def invocation_metadata(self) -> tuple:
        return self._metadata

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details
