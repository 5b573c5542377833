"""Typed exceptions for the gRPC status codes the calid API answers with."""
from __future__ import annotations

import grpc

from calid.errors import CalidError


class CalidAPIError(CalidError):
    """A call failed; ``code`` is the gRPC status, ``details`` the server's message."""

    code = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str, request_id: str | None = None, code: grpc.StatusCode | None = None):
        super().__init__(f"{(code or self.code).name}: {details}" + (f" (request {request_id})" if request_id else ""))
        self.details, self.request_id = details, request_id
        if code is not None:
            self.code = code


class InvalidArgument(CalidAPIError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(CalidAPIError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(CalidAPIError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(CalidAPIError):
    code = grpc.StatusCode.CANCELLED


class Unavailable(CalidAPIError):
    code = grpc.StatusCode.UNAVAILABLE


class NotFound(CalidAPIError):
    code = grpc.StatusCode.NOT_FOUND


class Unauthenticated(CalidAPIError):
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE = {c.code: c for c in (InvalidArgument, ResourceExhausted, DeadlineExceeded, Cancelled, Unavailable, NotFound,
                                Unauthenticated)}


# Ray Serve's proxy answers INTERNAL when the replica handling a call dies (it maps every Ray actor error
# to INTERNAL); for a client that is the server going away, as UNAVAILABLE says. Over Ray actor calls the
# details name ActorDiedError; over Serve's gRPC transport (RAY_SERVE_USE_GRPC_BY_DEFAULT) they say the actor
# "is unavailable".
_REPLICA_DIED = ("The actor died unexpectedly", "actor is dead", "ActorDiedError", "ActorUnavailableError",
                 "Actor is unavailable")


def status_of(e: grpc.RpcError) -> grpc.StatusCode:
    """The call's status, with a replica that died mid-call counted as UNAVAILABLE."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = (e.details() if hasattr(e, "details") else None) or ""
    if code == grpc.StatusCode.INTERNAL and any(s in details for s in _REPLICA_DIED):
        return grpc.StatusCode.UNAVAILABLE
    return code


def from_rpc_error(e: grpc.RpcError, request_id: str | None = None) -> CalidAPIError:
    code = status_of(e)
    details = (e.details() if hasattr(e, "details") else None) or str(e)
    cls = _BY_CODE.get(code, CalidAPIError)
    return cls(details, request_id) if cls is not CalidAPIError else CalidAPIError(details, request_id, code)
