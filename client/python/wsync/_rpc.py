"""The local API channel: a unix socket to the daemon, stubs generated from
proto/wsync/v1/local.proto at build time, errors as WsyncError."""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator

import grpc

from .errors import (ETCD_UNREACHABLE, NOT_REGISTERED, DeadlineExceededError, UnavailableError, WsyncError,
                     from_rpc_error)
from .v1 import local_pb2 as pb
from .v1 import local_pb2_grpc as pb_grpc

__all__ = ["Local", "pb", "again_if_forgotten", "transient", "backoff"]


def transient(e: WsyncError) -> bool:
    """Whether waiting may cure `e`: the daemon or its coordinator unreachable
    or slow (a restart, a failover), but not coordinator replicas that have
    already waited out etcd's missing majority (ETCD_UNREACHABLE)."""
    return isinstance(e, (UnavailableError, DeadlineExceededError)) and e.reason != ETCD_UNREACHABLE


def backoff(retry_for: float) -> Iterator[float]:
    """Sleeps before each retry, 0.1 s doubling to 2 s, while the next try
    starts within `retry_for` seconds of the first; yields the seconds left."""
    end = time.monotonic() + retry_for
    delay = 0.1
    while time.monotonic() + delay < end:
        time.sleep(delay)
        delay = min(2 * delay, 2.0)
        yield end - time.monotonic()


def _target(address: str) -> str:
    if address.startswith("unix:"):
        return address
    if address.startswith("/"):
        return "unix:" + address
    raise ValueError(f"the local API is a unix socket: 'unix:/path' or '/path', not {address!r}")


class Local:
    """A connection to one daemon's local API."""

    def __init__(self, address: str, timeout: float):
        self.address = _target(address)
        self.timeout = timeout
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.LocalStub(self.channel)

    def call(self, method: str, request: Any, timeout: float | None = None, wait_for_ready: bool = False) -> Any:
        fn: Callable[..., Any] = getattr(self.stub, method)
        try:
            return fn(request, timeout=self.timeout if timeout is None else timeout, wait_for_ready=wait_for_ready)
        except grpc.RpcError as e:
            raise from_rpc_error(e, f"{method} ({self.address})") from None

    def close(self) -> None:
        self.channel.close()


def again_if_forgotten(call: Callable[[], Any], reregister: Callable[[], None] | None) -> Any:
    """`call()`; when the daemon answers NOT_REGISTERED (it restarted and
    holds no tensors), `reregister()` (the same memory again) and `call()`
    once more. The one restart recovery of sources and sinks."""
    try:
        return call()
    except WsyncError as e:
        if e.reason != NOT_REGISTERED or reregister is None:
            raise
        reregister()
        return call()
