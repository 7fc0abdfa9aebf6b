"""The tensors a process registers with its daemon, and the memory they live
in.

CPU tensors are moved once, at registration, into memory this client
creates and owns, and the caller's tensors are rebound to views of it
(`tensor.data = view`): a module's Parameters keep their identity, so an
optimizer holding them keeps updating them in place, with no copy per step.
That memory is a memfd (no name anywhere): its descriptors go to the daemon
over its memory socket before each registration (again after a daemon
restart), and it ends with the last process that maps it, so a process
killed leaves nothing in /dev/shm. Where memfds do not exist, POSIX shared
memory under /dev/shm (mode 0600, unlinked when closed or at a normal exit).

CUDA tensors are never moved: the client exports the CUDA IPC handle of the
storage that holds each (torch's own storage sharing), one region per
storage; storages of one caching-allocator segment share one handle, which
the daemon maps once.
"""
from __future__ import annotations

import array
import itertools
import mmap
import os
import secrets
import socket
import time
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Tuple, Union, Sequence

import torch

from .v1 import local_pb2 as pb

DTYPE_NAMES: Dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.int64: "I64",
    torch.float64: "F64",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        DTYPE_NAMES[getattr(torch, _name)] = _code

_ALIGN = 256
_counter = itertools.count()

TensorsLike = Union[torch.nn.Module, Mapping[str, torch.Tensor]]


def named_tensors(obj: TensorsLike) -> List[Tuple[str, torch.Tensor]]:
    """The state_dict's tensors (names as in `state_dict()`), each storage
    once: a tied weight registers under its first name only."""
    if isinstance(obj, torch.nn.Module):
        items = list(obj.state_dict(keep_vars=True).items())
    elif isinstance(obj, Mapping):
        items = list(obj.items())
    else:
        raise TypeError(f"register takes a torch.nn.Module or a dict of tensors, not {type(obj).__name__}")
    out, seen = [], set()
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(t).__name__}, not a tensor")
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"tensor {name!r}: dtype {t.dtype} has no wsync encoding")
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape)) if t.numel() else (name,)
        if key in seen:
            continue
        seen.add(key)
        out.append((name, t))
    if not out:
        raise ValueError("no tensors to register")
    devices = {t.device.type for _, t in out}
    if len(devices) > 1:
        raise ValueError(f"tensors on {sorted(devices)}: register host tensors and CUDA tensors separately")
    return out


MEMFD = hasattr(os, "memfd_create")
_MAX_FDS_PER_MESSAGE = 253  # the kernel's SCM_MAX_FD


class SharedMemory:
    """Memory this process created to share with its daemon: a memfd whose
    descriptor it keeps open (`fd`), or, without memfds, a POSIX shared
    memory segment (`name`, mode 0600) unlinked when closed or when the
    process exits normally."""

    def __init__(self, size: int, role: str):
        self.size = max(size, 1)
        if MEMFD:
            self.name, self.fd = "", os.memfd_create(f"wsync-{role}", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, self.size)
            self.mmap = mmap.mmap(self.fd, self.size)
            self._finalizer = weakref.finalize(self, os.close, self.fd)
            return
        # A random part too: a killed process leaves its names behind, and pids are reused.
        self.name, self.fd = f"/wsync-{role}-{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}", -1
        fd = os.open("/dev/shm" + self.name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, self.size)
            self.mmap = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self._finalizer = weakref.finalize(self, _unlink, self.name)

    def tensor(self, offset: int, like: torch.Tensor, strided: bool = False) -> torch.Tensor:
        """A contiguous tensor shaped like `like` at `offset` in this segment;
        `strided`: strided like `like` too (dense: a permutation of a
        contiguous tensor, such as the transpose an FP8 engine holds its
        codes as)."""
        nbytes = like.numel() * like.element_size()
        raw = torch.frombuffer(self.mmap, dtype=torch.uint8, count=nbytes, offset=offset) if nbytes else \
            torch.empty(0, dtype=torch.uint8)
        raw = raw.view(like.dtype)
        return raw.as_strided(like.shape, like.stride()) if strided else raw.view(like.shape)

    def unlink(self) -> None:
        self._finalizer()
        self.fd = -1  # closed: never passed again


def _room_for_descriptors(regions: int) -> None:
    """A memfd region holds two descriptors while it lives (its own and its
    mmap's): with many (pack=False), the soft limit on open files is raised
    towards the hard one to make room."""
    if not MEMFD or regions < 64:
        return
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = soft + 2 * regions + 64
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def _unlink(name: str) -> None:
    try:
        os.unlink("/dev/shm" + name)
    except FileNotFoundError:
        pass


@dataclass
class Registration:
    """What a register call sent: the request, and what keeps its memory."""
    request: pb.RegisterTensorsRequest
    names: List[str]
    memory: List[SharedMemory] = field(default_factory=list)
    tensors: List[torch.Tensor] = field(default_factory=list)  # keeps CUDA storages alive

    def unlink(self) -> None:
        for m in self.memory:
            m.unlink()

    def pass_descriptors(self, address: str, timeout: float) -> None:
        """Sends the descriptors of this registration's memfds to the memory
        socket of the daemon at `address` (its local API's path + ".fds"),
        under a new token that the request's regions then name. Waits up to
        `timeout` for the socket (a daemon starting). Nothing to do for CUDA
        tensors or named shared memory."""
        fds = [m.fd for m in self.memory if m.fd >= 0]
        if not fds:
            return
        from .errors import UnavailableError
        path = address[len("unix:"):] + ".fds"
        token = secrets.token_hex(16)
        deadline = time.monotonic() + timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            try:
                sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError) as e:
                sock.close()
                if time.monotonic() >= deadline:
                    raise UnavailableError(f"the daemon's memory socket {path} is not there ({e.strerror}): is the "
                                           f"daemon at {address} running, and as new as this client?") from None
                time.sleep(0.05)
        with sock:
            sock.settimeout(max(1.0, deadline - time.monotonic()))
            for i in range(0, len(fds), _MAX_FDS_PER_MESSAGE):
                chunk = fds[i:i + _MAX_FDS_PER_MESSAGE]
                try:
                    sock.sendmsg([token.encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", chunk))])
                    answer = sock.recv(1)
                except OSError as e:  # the daemon went away, or did not answer in time
                    raise UnavailableError(f"passing memory to the daemon's memory socket {path}: {e}") from None
                if answer != b"k":
                    raise UnavailableError(f"the daemon's memory socket {path} refused {len(chunk)} descriptors "
                                           "(its log says why)")
        index = 0
        for region, m in zip(self.request.regions, self.memory):
            if m.fd >= 0:
                region.fd_token, region.fd_index = token, index
                index += 1


def _spec(name: str, t: torch.Tensor, region: int, offset: int) -> pb.TensorSpec:
    return pb.TensorSpec(name=name, dtype=DTYPE_NAMES[t.dtype], shape=list(t.shape), offset=offset, region=region)


def _owner(t: torch.Tensor) -> torch.Tensor:
    """What moves for `t`: the Parameter `t` is a view of (one expert of a
    fused MoE parameter, the transpose of one: the module reads the
    Parameter, which is rebound), or the one named by ``t.wsync_owner`` (a
    view in another dtype, which torch does not link to its base); else `t`
    itself (a view of anything else, a file's buffer say, is what its holder
    reads: it moves on its own)."""
    owner = getattr(t, "wsync_owner", None)
    if owner is not None:
        return owner
    base = t._base
    return base if isinstance(base, torch.nn.Parameter) else t


def _dense(t: torch.Tensor) -> bool:
    """Whether `t` covers its elements' span exactly once (contiguous, or a
    permutation of a contiguous tensor)."""
    span = 1
    for stride, n in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1):
        if stride != span:
            return False
        span *= n
    return True


def share_host(tensors: List[Tuple[str, torch.Tensor]], role: str, pack: bool) -> Registration:
    """Moves CPU tensors into shared memory (one segment, or one per tensor
    with pack=False) and rebinds each to its view there. A contiguous slice
    of a Parameter (one expert of a fused MoE parameter) lives where the
    Parameter does: the Parameter moves, once, and is rebound."""
    reg = Registration(pb.RegisterTensorsRequest(), [n for n, _ in tensors])
    # Units of memory to move: a tensor alone, or a base with the views of it that are registered.
    units: Dict[int, Tuple[torch.Tensor, List[Tuple[str, torch.Tensor]]]] = {}
    for name, t in tensors:
        base = _owner(t)
        if base is not t and not t.is_contiguous():
            raise ValueError(f"tensor {name!r} is a view that is not contiguous: the daemon writes it as a dense array")
        if base is not t and not _dense(base):
            raise ValueError(f"tensor {name!r} is a view of a parameter with gaps or overlaps (strides "
                             f"{base.stride()}): it cannot move into shared memory as the parameter is laid out")
        units.setdefault(id(base), (base, []))[1].append((name, t))
    groups = [list(units.values())] if pack else [[u] for u in units.values()]
    _room_for_descriptors(len(groups))
    for region, group in enumerate(groups):
        offsets, size = [], 0
        for base, _ in group:
            offsets.append(size)
            size += (base.numel() * base.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN
        shm = SharedMemory(size, role)
        reg.memory.append(shm)
        reg.request.regions.append(pb.MemoryRegion(shm_name=shm.name))  # a memfd's is set as it is passed
        for (base, members), off in zip(group, offsets):
            starts = [t.data_ptr() - base.data_ptr() for _, t in members]
            # A Parameter that registered views live in keeps its strides: they were taken from them.
            view = shm.tensor(off, base, strided=any(t is not base for _, t in members))
            with torch.no_grad():
                view.copy_(base)
            base.data = view  # the caller's tensor (a Parameter stays the same object) now lives in shared memory
            for (name, t), start in zip(members, starts):
                reg.request.tensors.append(_spec(name, t, region, off + start))
    return reg


CUDA_IPC_HANDLE_BYTES = 64


def cuda_mem_handle(name: str, handle: bytes) -> bytes:
    """The cudaIpcMemHandle_t in what torch's `_share_cuda_` returns: the bare
    64 bytes (torch 1.x), or [format version][kind][payload] (torch 2.x), where
    kind 'c' (a cudaMalloc block) carries the 64 bytes and 'e' (an expandable
    segment, which the legacy IPC API cannot open) carries something else."""
    if len(handle) == CUDA_IPC_HANDLE_BYTES:
        return handle
    if len(handle) == CUDA_IPC_HANDLE_BYTES + 2 and handle[1:2] == b"c":
        return handle[2:]
    if len(handle) >= 2 and handle[1:2] == b"e":
        raise ValueError(f"tensor {name!r} lives in one of torch's expandable segments, which CUDA IPC handles "
                         "cannot share; set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False in the trainer")
    raise ValueError(f"tensor {name!r}: torch returned a CUDA IPC handle of {len(handle)} bytes in a form wsync does "
                     f"not know (starting {handle[:2].hex()})")


def share_cuda(tensors: List[Tuple[str, torch.Tensor]]) -> Registration:
    """Exports the CUDA IPC handles of the storages holding the tensors (no
    copy, no move): one region per storage."""
    reg = Registration(pb.RegisterTensorsRequest(), [n for n, _ in tensors])
    regions: Dict[Tuple[int, int], int] = {}
    for name, t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"tensor {name!r} is not contiguous: the sink writes it as a dense array")
        storage = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()._untyped()
        key = (t.device.index, storage.data_ptr())
        if key not in regions:
            device, handle, size, offset = storage._share_cuda_()[:4]
            text = f"wsync-ipc-v1:{device}:{offset}:{size}:{cuda_mem_handle(name, handle).hex()}"
            regions[key] = len(reg.request.regions)
            reg.request.regions.append(pb.MemoryRegion(cuda_ipc_handle=text))
        offset = t.storage_offset() * t.element_size()
        reg.request.tensors.append(_spec(name, t, regions[key], offset))
        reg.tensors.append(t)
    return reg


def _pieces(rt) -> List[pb.PieceSpec]:
    return [pb.PieceSpec(canonical=p.canonical, start=list(p.start), extent=list(p.extent), at=list(p.at))
            for p in rt.pieces]


def attach_layout(reg: Registration, layout: Sequence) -> None:
    """Gives every registered tensor the pieces its runtime tensor holds
    (`layout`: wsync.layouts.RuntimeTensor s, by name). Raises ValueError
    naming a tensor the layout lacks, one it has that was not registered, or
    a shape that differs."""
    by_name = {rt.name: rt for rt in layout}
    if len(by_name) != len(layout):
        raise ValueError("the layout names a runtime tensor twice")
    for spec in reg.request.tensors:
        rt = by_name.pop(spec.name, None)
        if rt is None:
            raise ValueError(f"tensor {spec.name!r} is not in the layout")
        if tuple(spec.shape) != tuple(rt.shape):
            raise ValueError(f"tensor {spec.name!r} is {tuple(spec.shape)}, the layout says {tuple(rt.shape)}")
        spec.pieces.extend(_pieces(rt))
    if by_name:
        raise ValueError(f"the layout's tensor {next(iter(by_name))!r} was not registered")


def served_layout(layout: Sequence, dtypes: Dict[str, str]) -> pb.ServedLayout:
    """A sink layout a source serves; `dtypes`: the published dtype of every
    canonical tensor (a runtime tensor has its pieces' dtype)."""
    out = pb.ServedLayout()
    for rt in layout:
        dtype = dtypes.get(rt.pieces[0].canonical, "BF16") if rt.pieces else "BF16"
        out.tensors.append(pb.TensorSpec(name=rt.name, dtype=dtype, shape=list(rt.shape), pieces=_pieces(rt)))
    return out


def share(obj: TensorsLike, role: str, pack: bool = True) -> Registration:
    tensors = named_tensors(obj)
    if tensors[0][1].is_cuda:
        return share_cuda(tensors)
    return share_host(tensors, role, pack)
