"""Inference-engine adapters: each tensor-parallel rank of a vLLM or SGLang
server registers its own parameters, in place, with the wsync sink on its
GPU, and takes new versions only when the RL loop asks, between generation
steps.

The engines hold fused and sharded parameters (``qkv_proj``,
``gate_up_proj``, row and column shards, a padded vocabulary);
:func:`wsync.layouts.tp_layout` says which pieces of the published tensors
each rank holds, and the sink applies exactly those, verified. The trainer's
source must serve these layouts (``Source.register(model, serve=[...])``).

vLLM 0.22 and later: wsync is a weight-transfer backend (wsync.vllm).
Older vLLM (worker extension)::

    llm = LLM(model=path, tensor_parallel_size=4,
              worker_extension_cls="wsync.vllm.VllmWorkerExtension")
    llm.collective_rpc("wsync_register", args=("unix:/run/wsync/sink-{tp_rank}.sock",))
    ...                                        # generate
    llm.collective_rpc("wsync_sync", args=(step,))   # between steps: version `step` or newer
    llm.reset_prefix_cache()                   # cached KV of the old weights is stale

SGLang (custom weight loader, SGLang >= 0.4.8)::

    engine = sglang.Engine(model_path=path, tp_size=4,
                           custom_weight_loader=["wsync.engines.sglang_load"])
    # each rank's sink address: WSYNC_SINK_ADDRESS (a template with {rank}),
    # default unix:/run/wsync/sink-{rank}.sock
    engine.update_weights_from_tensor(wsync.engines.sglang_request(step),
                                      load_format="wsync.engines.sglang_load")

vLLM runs against this module in tests/python/vllm_test.py; SGLang does not
run where wsync is tested (docs/vllm.md says what was checked).
"""
from __future__ import annotations

import os
from typing import Callable, Mapping, Optional, Sequence

import torch

from .layouts import RuntimeTensor, runtime_tensor, tp_layout
from .sink import Sink

__all__ = ["RankSync", "VllmWorkerExtension", "sglang_load", "sglang_request"]

DEFAULT_ADDRESS = "unix:/run/wsync/sink-{rank}.sock"


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


def _address(template: str, **ranks: int) -> str:
    """A rank's sink address: `template` with {rank} (the TP rank), {tp_rank},
    {tp_size} and {dp_rank} filled in."""
    ranks.setdefault("rank", ranks.get("tp_rank", 0))
    try:
        return template.format(**ranks)
    except (KeyError, IndexError) as e:
        raise ValueError(f"sink address template {template!r}: unknown field {e} "
                         f"(fields: {', '.join('{%s}' % k for k in sorted(ranks))})") from None


_sglang: Optional[RankSync] = None
_VERSION = "wsync.version"


def sglang_request(version: Optional[int] = None) -> list:
    """The `named_tensors` of ``Engine.update_weights_from_tensor`` that make
    every rank's :func:`sglang_load` sync to `version` (None: the newest)."""
    return [(_VERSION, torch.tensor([-1 if version is None else int(version)], dtype=torch.int64))]


def sglang_load(model: torch.nn.Module, named_tensors) -> None:
    """SGLang's custom weight loader, run in each tensor-parallel worker: the
    first call registers the worker's parameters with its sink, every call
    syncs to the version in the request (sglang_request)."""
    global _sglang
    request = dict(named_tensors)
    if set(request) != {_VERSION}:
        raise ValueError(f"wsync.engines.sglang_load takes sglang_request(version), not {sorted(request)[:3]}")
    version = int(request[_VERSION].reshape(-1)[0].item())
    if _sglang is None:
        from sglang.srt.distributed import parallel_state as ps
        rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        address = _address(os.environ.get("WSYNC_SINK_ADDRESS", DEFAULT_ADDRESS), tp_rank=rank, tp_size=size,
                           dp_rank=0)
        _sglang = RankSync(dict(model.named_parameters()), tp_layout(model.config.to_dict(), size, rank), address,
                           what=f"rank {rank} of {size}")
    _sglang.sync(None if version < 0 else version)
