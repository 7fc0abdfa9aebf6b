"""Exceptions of the wsync client: one class per family of gRPC status codes,
each carrying the daemon's message."""
from __future__ import annotations

from typing import Optional

import grpc


class WsyncError(Exception):
    """An error from a wsync daemon (or the client itself).

    Attributes:
        code: the gRPC status code name ("FAILED_PRECONDITION", ...).
        message: the daemon's message.
    """

    def __init__(self, message: str, code: str = "UNKNOWN"):
        super().__init__(message)
        self.code = code
        self.message = message


class InvalidArgumentError(WsyncError):
    """The request was malformed (bad dtype, tensors outside their memory)."""


class NotFoundError(WsyncError):
    """What was named does not exist (a hold that ended, an unknown version)."""


class FailedPreconditionError(WsyncError):
    """The system is not in a state to do this: nothing registered, tensors
    that do not match the published layout, a version not above the head."""


class StaleVersionError(FailedPreconditionError):
    """A version at or below the head was published; `next_version` is the
    lowest one that would be accepted now."""

    def __init__(self, message: str, next_version: int):
        super().__init__(message, "FAILED_PRECONDITION")
        self.next_version = next_version


class AbortedError(WsyncError):
    """The operation was refused as things stand: a publish held back by the
    staleness bound (the message names the lagging sinks and why)."""


class UnavailableError(WsyncError):
    """The daemon or its coordinator or parent cannot be reached."""


class DeadlineExceededError(WsyncError):
    """A wait ran out (the message says what the daemon last saw)."""


class DataLossError(WsyncError):
    """Corrupt data was refused (nothing was changed)."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.ALREADY_EXISTS: FailedPreconditionError,
    grpc.StatusCode.ABORTED: AbortedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: AbortedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.CANCELLED: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.DATA_LOSS: DataLossError,
}


def from_rpc_error(err: grpc.RpcError, what: Optional[str] = None) -> WsyncError:
    """The WsyncError for a failed call (`what`: prefix naming the call)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    message = f"{what}: {details}" if what else (details or "")
    cls = _BY_CODE.get(code, WsyncError)
    return cls(message, code.name if code is not None else "UNKNOWN")
