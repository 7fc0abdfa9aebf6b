"""Exceptions of the wsync client: one class per family of gRPC status codes,
each carrying the daemon's message and, where the daemon gave one, its
machine-readable reason (gRPC's rich error model: google.rpc.ErrorInfo in the
call's trailer). The client decides on reasons, never on message text."""
from __future__ import annotations

from typing import Dict, Optional

import grpc

from .v1 import errors_pb2

# The reasons the client acts on (docs/local-api.md, "Errors").
STALE_VERSION = "STALE_VERSION"    # metadata: version, head_version, next_version
VERSION_TAKEN = "VERSION_TAKEN"    # metadata: version, next_version
NOT_REGISTERED = "NOT_REGISTERED"  # the daemon (restarted?) holds no tensors
ETCD_UNREACHABLE = "ETCD_UNREACHABLE"  # coordinator replicas without etcd's majority: not transient


class WsyncError(Exception):
    """An error from a wsync daemon (or the client itself).

    Attributes:
        code: the gRPC status code name ("FAILED_PRECONDITION", ...).
        message: the daemon's message.
        reason: the daemon's machine-readable reason ("STALE_VERSION", ...), or "".
        metadata: the reason's details by name (strings).
    """

    def __init__(self, message: str, code: str = "UNKNOWN", reason: str = "",
                 metadata: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.metadata = dict(metadata or {})


class InvalidArgumentError(WsyncError):
    """The request was malformed (bad dtype, tensors outside their memory)."""


class NotFoundError(WsyncError):
    """What was named does not exist (a hold that ended, an unknown version)."""


class FailedPreconditionError(WsyncError):
    """The system is not in a state to do this: nothing registered, tensors
    that do not match the published layout, a version not above the head."""


class StaleVersionError(FailedPreconditionError):
    """A version at or below the head was published (reason STALE_VERSION),
    or one whose number a failed publish of other weights took
    (VERSION_TAKEN); `next_version` is the lowest one accepted now."""

    def __init__(self, message: str, next_version: int, reason: str = STALE_VERSION,
                 metadata: Optional[Dict[str, str]] = None):
        super().__init__(message, "FAILED_PRECONDITION", reason, metadata)
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


_ERROR_INFO = "type.googleapis.com/google.rpc.ErrorInfo"


def _reason(err: grpc.RpcError) -> tuple:
    """(reason, metadata) from the call's grpc-status-details-bin trailer."""
    trailer = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in trailer or ():
        if key != "grpc-status-details-bin":
            continue
        status = errors_pb2.RpcStatus.FromString(value)
        for any_ in status.details:
            if any_.type_url == _ERROR_INFO:
                info = errors_pb2.ErrorInfo.FromString(any_.value)
                if info.domain == "wsync":
                    return info.reason, dict(info.metadata)
    return "", {}


def from_rpc_error(err: grpc.RpcError, what: Optional[str] = None) -> WsyncError:
    """The WsyncError for a failed call (`what`: prefix naming the call)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    message = f"{what}: {details}" if what else (details or "")
    reason, metadata = _reason(err)
    if reason in (STALE_VERSION, VERSION_TAKEN) and "next_version" in metadata:
        return StaleVersionError(message, int(metadata["next_version"]), reason, metadata)
    cls = _BY_CODE.get(code, WsyncError)
    return cls(message, code.name if code is not None else "UNKNOWN", reason, metadata)
