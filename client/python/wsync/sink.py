"""The inference side: register the model's tensors in place, hold them
around each batch, wait for versions."""
from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import grpc

from ._rpc import Local, again_if_forgotten, pb
from ._tensors import Registration, TensorsLike, attach_layout, share
from .errors import FailedPreconditionError, UnavailableError, from_rpc_error


@dataclass(frozen=True)
class Hold:
    """A hold taken by Sink.acquire: its id at the sink and its call."""
    id: int
    call: Any


class Sink:
    """An inference server's connection to its `wsyncd sink`.

    >>> snk = wsync.Sink("unix:/run/wsync/sink.sock")
    >>> snk.register(model)                 # the sink writes these tensors
    >>> with snk.hold() as version:         # no apply while held
    ...     generate(...)
    >>> snk.wait(version + 1, timeout=30)

    Holds are leases: one ends when the `with` block exits, when this process
    dies (its connection closes), or when it is not renewed within its TTL
    (a background thread renews it while the block runs). Thread-safe.
    """

    def __init__(self, address: str = "unix:/run/wsync/sink.sock", *, timeout: float = 60.0,
                 hold_ttl: Optional[float] = None):
        """`hold_ttl`: seconds a hold lasts without renewal (default: the
        sink's --hold-ttl-ms); renewed every third of it while held."""
        self._local = Local(address, timeout)
        self._registration: Optional[Registration] = None
        self._hold_ttl_ms = int(hold_ttl * 1000) if hold_ttl else 0
        self._lock = threading.Lock()
        self._holds: Dict[int, float] = {}  # hold id -> renewal period (s)
        self._renewer: Optional[threading.Thread] = None
        self._wake = threading.Event()
        self._closed = False
        self._held = 0  # the last version this client saw its tensors hold

    def register(self, model: TensorsLike, *, version: int = 0, pack: bool = True,
                 layout: Optional[Sequence] = None) -> None:
        """Registers a module's state_dict tensors (or a dict of tensors) in
        place: CPU tensors move into shared memory owned by this client and
        are rebound (the module computes with them as before); CUDA tensors
        are shared over CUDA IPC where they are. `version`: what they hold
        already (0: nothing; the sink checks a claim against the version's
        checksum).

        `layout`: the tensors are an inference engine's runtime tensors
        (tensor-parallel shards, fused qkv / gate_up), each holding the
        pieces of published tensors this list of wsync.layouts.RuntimeTensor
        says (`wsync.layouts.tp_layout`). The sink applies exactly those
        pieces and never writes elsewhere (padding). A claimed version cannot
        be checked over pieces: such a sink starts from a keyframe.

        Raises FailedPreconditionError naming the first tensor whose name,
        dtype or shape differs from the published layout (with `layout`: a
        piece the source's tile grid does not hold: the trainer's source must
        serve this layout), ValueError when `layout` and the tensors differ.
        """
        reg = share(model, "sink", pack)
        if layout is not None:
            try:
                attach_layout(reg, layout)
            except ValueError:
                reg.unlink()
                raise
        reg.request.applied_version = version
        reg.pass_descriptors(self._local.address, self._local.timeout)
        self._local.call("RegisterTensors", reg.request, wait_for_ready=True)
        old, self._registration = self._registration, reg
        self._held = version
        if old is not None:
            old.unlink()

    def _again(self, call):
        """`call()`, after registering the same memory again if the daemon
        restarted and forgot it."""
        return again_if_forgotten(call, self._reregister if self._registration is not None else None)

    def _reregister(self) -> None:
        # Saying which version the tensors hold: the sink checks that against the version's checksum.
        self._registration.request.applied_version = self._held
        self._registration.pass_descriptors(self._local.address, self._local.timeout)
        self._local.call("RegisterTensors", self._registration.request, wait_for_ready=True)

    def _through_restart(self, call, deadline: float):
        """`call()`, again while the daemon is unreachable (restarting: its
        socket is back within seconds) until `deadline`; then the error."""
        while True:
            try:
                return call()
            except UnavailableError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    def acquire(self, ttl: Optional[float] = None) -> Tuple[int, "Hold"]:
        """Takes a hold: the weights stay as they are (the sink applies new
        versions only between holds) until :meth:`release`. Returns the
        version held and the hold. The client renews it in the background;
        it also ends when this process dies or its TTL passes unrenewed."""
        ttl_ms = int(ttl * 1000) if ttl else self._hold_ttl_ms
        req = pb.HoldRequest(ttl_ms=ttl_ms, holder=f"pid {os.getpid()}")

        def start():
            call = self._local.stub.Hold(req, timeout=None)
            try:
                return call, next(call)
            except grpc.RpcError as e:
                raise from_rpc_error(e, f"Hold ({self._local.address})") from None
        call, first = self._through_restart(lambda: self._again(start), time.monotonic() + self._local.timeout)
        self._held = first.version
        self._track(first.hold_id, first.ttl_ms / 3000.0)
        return first.version, Hold(first.hold_id, call)

    def release(self, hold: "Hold") -> None:
        """Ends a hold (at most once; one that ended already is no error)."""
        self._untrack(hold.id)
        try:
            self._local.stub.Release(pb.ReleaseRequest(hold_id=hold.id), timeout=self._local.timeout)
        except grpc.RpcError:
            pass  # ended already (TTL, shutdown): nothing is held
        hold.call.cancel()

    @contextlib.contextmanager
    def hold(self, ttl: Optional[float] = None) -> Iterator[int]:
        """Holds the weights stable for a ``with`` block; yields the version
        they hold (acquire, then release at the block's end)."""
        version, hold = self.acquire(ttl)
        try:
            yield version
        finally:
            self.release(hold)

    def wait(self, version: int, timeout: float = 30.0) -> int:
        """Blocks until `version` (or a later one) is applied; returns the
        applied version. Raises DeadlineExceededError with the sink's last
        sync error, or at once FailedPreconditionError when the registered
        tensors cannot take the published versions. hold() and wait()
        register the same memory again if the sink restarted, and ride out
        a restart under way (the daemon unreachable for a while): wait()
        within its timeout, hold() within the client's."""
        deadline = time.monotonic() + timeout

        def wait_once():
            left = max(0.0, deadline - time.monotonic())
            req = pb.WaitForVersionRequest(version=version, timeout_ms=int(left * 1000))
            return self._local.call("WaitForVersion", req, timeout=left + self._local.timeout, wait_for_ready=True)
        return self._through_restart(lambda: self._again(wait_once), deadline).applied_version

    def status(self) -> pb.LocalStatusResponse:
        """The sink's view: applied and head versions, sync error, holds."""
        return self._local.call("Status", pb.LocalStatusRequest())

    @property
    def version(self) -> int:
        """The version the registered tensors hold now."""
        return self.status().version

    def unregister(self) -> None:
        """Ends the holds and forgets the tensors: the sink writes them no more."""
        if self._registration is None:
            raise FailedPreconditionError("unregister: nothing registered", "FAILED_PRECONDITION")
        self._local.call("Unregister", pb.UnregisterRequest())
        self._registration.unlink()
        self._registration = None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.set()
        if self._registration is not None:
            self._registration.unlink()
        self._local.close()

    def __enter__(self) -> "Sink":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # One renewal thread for every hold of this client.
    def _track(self, hold_id: int, period: float) -> None:
        with self._lock:
            self._holds[hold_id] = max(period, 0.05)
            if self._renewer is None or not self._renewer.is_alive():
                self._renewer = threading.Thread(target=self._renew_loop, name="wsync-hold-renewal", daemon=True)
                self._renewer.start()
            self._wake.set()

    def _untrack(self, hold_id: int) -> None:
        with self._lock:
            self._holds.pop(hold_id, None)

    def _renew_loop(self) -> None:
        due: Dict[int, float] = {}
        while True:
            with self._lock:
                if self._closed or not self._holds:
                    self._renewer = None
                    return
                now = time.monotonic()
                holds = dict(self._holds)
            for hold_id, period in holds.items():
                if now >= due.setdefault(hold_id, now + period):
                    try:
                        self._local.stub.RenewHold(pb.RenewHoldRequest(hold_id=hold_id), timeout=max(period, 1.0))
                    except grpc.RpcError:
                        pass  # the hold ended; the with block finds out on release
                    due[hold_id] = now + period
            for gone in set(due) - set(holds):
                del due[gone]
            self._wake.wait(timeout=min(holds.values()) / 2)
            self._wake.clear()
