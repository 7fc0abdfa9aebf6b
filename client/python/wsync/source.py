"""The trainer side: register the model once, publish after every step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from ._rpc import Local, again_if_forgotten, backoff, pb, transient
from ._tensors import Registration, TensorsLike, named_tensors, share, served_layout
from .errors import (STALE_VERSION, DeadlineExceededError, FailedPreconditionError, StaleVersionError,
                     UnavailableError)
from .layouts import Piece, RuntimeTensor
from .quantized import QuantizedTensors, owned, requested


@dataclass
class RegisterInfo:
    """What a registration established.

    Attributes:
        tensors: names registered (the state_dict's, tied weights once).
        cast_to_bf16: F32 tensors the source publishes as BF16 (round to
            nearest even, bit-identical to tensor.to(torch.bfloat16)).
        head_version: the newest version the coordinator knows.
        next_version: the lowest version publish accepts now.
    """
    tensors: List[str]
    cast_to_bf16: List[str]
    head_version: int
    next_version: int


@dataclass
class PublishStats:
    """What a publish did.

    Attributes:
        version: the version published.
        base_version: the version the patch starts from (0: keyframe).
        patch_bytes: bytes of the patch (0 while pending).
        dense_bytes: bytes of the published (BF16) tensors.
        ratio: dense_bytes / patch_bytes (0 while pending).
        encode_ms: snapshot + encode + announce, as the trainer waited.
        copy_ms: with after_copy: the copy the trainer waited for.
        pending: with after_copy: encoded and announced in the background;
            a failure is raised by the next publish.
        server_ms: the daemon's whole time in the call (coordinator checks,
            the wait for a previous background publish, copy or encode).
    """
    version: int
    base_version: int
    patch_bytes: int
    dense_bytes: int
    ratio: float
    encode_ms: float
    copy_ms: float
    pending: bool
    server_ms: float


class Source:
    """A trainer's connection to its `wsyncd source`.

    >>> src = wsync.Source("unix:/run/wsync/source.sock")
    >>> src.register(model)          # CPU tensors move into shared memory once
    >>> src.publish(step)            # after optimizer.step()

    Not thread-safe: one trainer thread publishes.
    """

    def __init__(self, address: str = "unix:/run/wsync/source.sock", *, timeout: float = 60.0):
        """`timeout`: seconds for calls other than publish's own wait."""
        self._local = Local(address, timeout)
        self._registration: Optional[Registration] = None
        self._quantized: Optional[QuantizedTensors] = None
        self._next_version = 1

    def register(self, model: TensorsLike, *, pack: bool = True, serve: Sequence[Sequence] = (),
                 serve_offered: bool = False, part: Optional[Tuple[int, int]] = None) -> RegisterInfo:
        """Registers a module's state_dict tensors (or a dict of tensors).

        CPU tensors are moved into shared memory owned by this client (one
        segment, or one per tensor with pack=False) and rebound in place;
        CUDA tensors stay where they are and are shared over CUDA IPC. F32
        tensors are published as BF16. Registering again replaces the table.

        `serve`: the runtime layouts of the inference ranks whose sinks hold
        pieces (one list of wsync.layouts.RuntimeTensor per rank, e.g.
        ``[tp_layout(config, 4, r) for r in range(4)]``, several TP degrees
        at once if need be). Versions are then coded so that each rank's
        sink decodes and verifies its own shard alone.

        `serve_offered`: also serve every layout the sinks offered to the
        coordinator (a sink registering pieces offers its layout: wsync.vllm's
        workers derive theirs from vLLM's own loader), read now and before
        every publish: a layout offered later is served from the next
        version on.

        Layouts whose sinks hold quantized forms of tensors (an FP8 engine's
        codes and scales: wsync.quantized names them) get them: the source
        quantizes those tensors with the engine's own functions (vLLM's, in
        this process) and registers them too, and quantizes them again
        before every publish.

        `part=(i, n)`: this source is one of n (trainer ranks or pipeline
        stages), each registering a disjoint subset of the tensors and
        publishing the same version numbers; a version reaches the sinks only
        once all n have published it, and sinks apply it whole.

        Registering again with other `serve` layouts (a resized rollout
        fleet) codes the next version, a patch from the head, on the new
        tile grid; sinks behind the head get keyframes.

        Raises FailedPreconditionError naming the tensor when the tensors
        differ from the ones the coordinator already recorded,
        InvalidArgumentError naming a served piece that does not fit the
        model.
        """
        layouts = [list(layout) for layout in serve] + (self.offered_layouts() if serve_offered else [])
        wanted = requested(layouts)
        quantized = None
        if wanted:
            weights = dict(named_tensors(model))
            if part is not None:  # the other parts quantize theirs
                wanted = owned(wanted, weights)
            quantized = QuantizedTensors(weights, wanted)
            model = {**weights, **quantized.tensors}
        reg = share(model, "source", pack)
        if part is not None:
            reg.request.part, reg.request.parts = int(part[0]), int(part[1])
        reg.request.serve_offered_layouts = bool(serve_offered)
        if serve:
            published = {s.name: ("BF16" if s.dtype == "F32" else s.dtype) for s in reg.request.tensors}
            reg.request.serve_layouts.extend(served_layout(layout, published) for layout in serve)
        reg.pass_descriptors(self._local.address, self._local.timeout)
        resp = self._local.call("RegisterTensors", reg.request, wait_for_ready=True)
        old, self._registration = self._registration, reg
        if old is not None:
            old.unlink()
        self._quantized = quantized
        self._next_version = resp.next_version or resp.head_version + 1
        return RegisterInfo(reg.names, list(resp.cast_to_bf16), resp.head_version, self._next_version)

    @property
    def next_version(self) -> int:
        """The lowest version publish accepts (the head + 1, also after a
        restart of any process)."""
        return self._next_version

    def publish(self, version: Optional[int] = None, *, after_copy: bool = False,
                wait: float = 60.0, retry_for: float = 60.0) -> PublishStats:
        """Publishes the registered tensors as `version` (default: next_version).

        Returns once the version is encoded and announced, or with
        after_copy=True once the source has copied the weights (the trainer
        may step again at once). When the staleness bound holds the version
        back, waits up to `wait` seconds, then raises AbortedError naming the
        lagging sinks and why they lag. A version at or below the head raises
        StaleVersionError carrying next_version. If the daemon restarted (it
        knows no tensors), the same memory is registered again first.

        Transient failures (the daemon restarting, a coordinator failover,
        slow or not: UnavailableError, DeadlineExceededError) are retried for
        up to `retry_for` seconds. Coordinator replicas that cannot reach a
        majority of etcd raise UnavailableError with reason ETCD_UNREACHABLE
        at once, naming what to check, a few seconds past their lease.
        """
        if self._registration is None:
            raise FailedPreconditionError("publish: nothing registered (call register first)", "FAILED_PRECONDITION")
        v = self._next_version if version is None else int(version)
        if self._quantized is not None:
            self._quantized.refresh()
        req = pb.LocalPublishRequest(version=v, wait_ms=int(wait * 1000), return_after_copy=after_copy)
        def call():
            # The source announces an unconfirmed version again; a version it
            # confirmed meanwhile is answered as stale with the next one,
            # which after a transient failure means: published.
            retried = False
            retries = backoff(retry_for)
            while True:
                try:
                    return self._local.call("Publish", req, timeout=self._local.timeout + wait, wait_for_ready=True)
                except (UnavailableError, DeadlineExceededError) as e:
                    if not transient(e) or next(retries, None) is None:
                        raise
                    retried = True
                except StaleVersionError as e:
                    # Our version is the head after a transient failure: it
                    # was stored (its answer was lost), not someone else's.
                    if retried and e.reason == STALE_VERSION and e.metadata.get("head_version") == str(v):
                        return pb.LocalPublishResponse(version=v)
                    raise
        try:
            resp = again_if_forgotten(call, self._reregister)
        except StaleVersionError as e:
            self._next_version = e.next_version
            raise
        self._next_version = max(self._next_version, resp.version + 1)
        return PublishStats(
            version=resp.version, base_version=resp.base_version, patch_bytes=resp.patch_bytes,
            dense_bytes=resp.dense_bytes,
            ratio=resp.dense_bytes / resp.patch_bytes if resp.patch_bytes else 0.0,
            encode_ms=resp.encode_ms, copy_ms=resp.copy_ms, pending=resp.pending, server_ms=resp.server_ms)

    def _reregister(self) -> None:
        self._registration.pass_descriptors(self._local.address, self._local.timeout)
        self._local.call("RegisterTensors", self._registration.request, wait_for_ready=True)

    def offered_layouts(self) -> List[List[RuntimeTensor]]:
        """The layouts sinks offered to the coordinator (each a list of
        wsync.layouts.RuntimeTensor), as they offered them: what the
        engines' ranks hold. A trainer reads them before registering to
        learn which tensors to publish (an FP8 engine's sinks name the FP8
        codes and scales they hold: docs/fp8.md)."""
        resp = self._local.call("OfferedLayouts", pb.OfferedLayoutsRequest(), wait_for_ready=True)
        return [[RuntimeTensor(t.name, tuple(t.shape), tuple(Piece(p.canonical, tuple(p.start), tuple(p.extent),
                                                                     tuple(p.at)) for p in t.pieces))
                 for t in layout.tensors] for layout in resp.layouts]

    def status(self) -> pb.LocalStatusResponse:
        """The daemon's view: head version, tensors, bytes and pulls served."""
        return self._local.call("Status", pb.LocalStatusRequest())

    def unregister(self) -> None:
        """Forgets the tensors; the shared memory is released (the tensors
        stay usable in this process)."""
        self._local.call("Unregister", pb.UnregisterRequest())
        if self._registration is not None:
            self._registration.unlink()
            self._registration = None

    def close(self) -> None:
        """Closes the connection and unlinks the shared memory names (the
        daemon keeps its mapping until it is told otherwise)."""
        if self._registration is not None:
            self._registration.unlink()
        self._local.close()

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
