"""One inference-engine rank's parameters kept by its wsync sink: the core
that the engine packages (wsync.vllm, wsync.sglang) share.

Each tensor-parallel rank of an engine registers its own parameters, in
place, with the sink on its node, together with the layout that says which
pieces of the published tensors each parameter holds (fused and sharded
parameters, row and column shards, a padded vocabulary); the sink applies
exactly those, verified, and only while the rank lets it: between
generation steps, when the RL loop asks (:meth:`RankSync.sync`).
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import torch

from .layouts import RuntimeTensor, runtime_tensor
from .sink import Sink

__all__ = ["RankSync", "rank_address"]


class RankSync:
    """One tensor-parallel rank's parameters kept by its sink: registered in
    place with their layout, and held (no apply) except inside :meth:`sync`.

    ``params``: the engine's parameters by name (``model.named_parameters()``);
    ``layout``: what each holds (wsync.layouts.RuntimeTensor s: derived from
    vLLM's loader by wsync.vllm, or tp_layout). ``unpacked``: parameters
    whose forward pass reads a repacked copy (a CPU MoE kernel's blocked
    layout), by name: ``(tensor, repack)``, the tensor in the checkpoint's
    layout that the sink writes instead and ``repack()`` that rebuilds the
    parameter from it. ``after_version``: what the engine recomputes from
    the parameters (derived weights), run with the repacks after every
    version, before the engine runs again. Raises ValueError naming a
    parameter the layout lacks or a shape that differs, before anything is
    registered.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], layout: Sequence[RuntimeTensor], address: str,
                 timeout: float = 60.0, unpacked: Optional[Mapping[str, tuple]] = None,
                 after_version: Sequence[Callable[[], None]] = (), what: str = "this rank"):
        unpacked = dict(unpacked or {})
        targets = {**params, **{n: t for n, (t, _) in unpacked.items()}}
        tensors = {}
        for rt in layout:
            try:
                tensors[rt.name] = runtime_tensor(targets, rt.name)
            except (KeyError, IndexError):
                raise ValueError(f"the layout's {rt.name!r} is not a parameter of the model") from None
            if tuple(tensors[rt.name].shape) != tuple(rt.shape):
                raise ValueError(f"parameter {rt.name!r} is {tuple(tensors[rt.name].shape)}, "
                                 f"the layout of {what} says {tuple(rt.shape)}")
        self._after = [repack for _, repack in unpacked.values()] + list(after_version)
        self._sink = Sink(address, timeout=timeout)
        self._sink.register(tensors, layout=layout)
        self._hold: Optional[int] = None
        self.version = 0
        self._acquire()
        if self.version:  # applied between registering and holding
            self._recompute()

    def _acquire(self) -> None:
        self.version, self._hold = self._sink.acquire()

    def _release(self) -> None:
        hold, self._hold = self._hold, None
        if hold is not None:
            self._sink.release(hold)

    def sync(self, version: Optional[int] = None, timeout: float = 60.0) -> int:
        """Lets the sink apply until the parameters hold `version` or newer
        (None: the newest version the sink knows of), then holds them again;
        returns the version they hold. Call it only while the engine does not
        generate. Raises DeadlineExceededError (the sink's last sync error
        with it) when the version does not arrive in time: the parameters
        then hold a whole older version, never part of one."""
        before = self.version
        self._release()
        try:
            target = self._sink.status().head_version if version is None else version
            if target > self.version:
                self._sink.wait(target, timeout=timeout)
        finally:
            self._acquire()
            if self.version != before:
                self._recompute()
        return self.version

    def _recompute(self) -> None:
        for step in self._after:  # what the forward pass reads, from what the sink wrote
            step()

    def close(self) -> None:
        self._release()
        self._sink.close()


def rank_address(template: str, **ranks: int) -> str:
    """A rank's sink address: `template` with {rank} (the TP rank), {tp_rank},
    {tp_size} and {dp_rank} filled in."""
    ranks.setdefault("rank", ranks.get("tp_rank", 0))
    try:
        return template.format(**ranks)
    except (KeyError, IndexError) as e:
        raise ValueError(f"sink address template {template!r}: unknown field {e} "
                         f"(fields: {', '.join('{%s}' % k for k in sorted(ranks))})") from None
