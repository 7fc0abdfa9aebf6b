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
              worker_extension_cls="wsync.engines.VllmWorkerExtension")
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

import functools
import os
from typing import Mapping, Optional

import torch

from .layouts import runtime_tensor, tp_layout
from .sink import Sink

__all__ = ["RankSync", "VllmWorkerExtension", "sglang_load", "sglang_request"]

DEFAULT_ADDRESS = "unix:/run/wsync/sink-{rank}.sock"


class RankSync:
    """One tensor-parallel rank's parameters kept by its sink: registered in
    place with their layout, and held (no apply) except inside :meth:`sync`.

    ``params``: the engine's parameters by name (``model.named_parameters()``);
    ``config``: the model's ``config.json`` as a dict; ``layout_args``: the
    MoE group of :func:`wsync.layouts.tp_layout`. ``unpacked``: parameters
    whose forward pass reads a repacked copy (a CPU MoE kernel's blocked
    layout), by name: ``(tensor, repack)``, the tensor in the checkpoint's
    layout that the sink writes instead and ``repack()`` that rebuilds the
    parameter from it after every version. Raises ValueError naming a
    parameter the layout lacks or has, or a shape that differs (a model
    family or TP split wsync.layouts does not describe), before anything is
    registered.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], config: Mapping, tp_size: int, tp_rank: int,
                 address: str, timeout: float = 60.0, layout_args: Optional[dict] = None,
                 unpacked: Optional[Mapping[str, tuple]] = None):
        layout = tp_layout(config, tp_size, tp_rank, **(layout_args or {}))
        unpacked = dict(unpacked or {})
        targets = {**params, **{n: t for n, (t, _) in unpacked.items()}}
        names = {rt.name.partition("[")[0] for rt in layout}
        unknown = sorted(n for n in params if n not in names)
        if unknown:
            raise ValueError(f"parameters the layout does not describe (they would never be updated): {unknown[:5]}")
        tensors = {}
        for rt in layout:
            try:
                tensors[rt.name] = runtime_tensor(targets, rt.name)
            except KeyError:
                raise ValueError(f"the layout's {rt.name!r} is not a parameter of the model") from None
            if tuple(tensors[rt.name].shape) != tuple(rt.shape):
                raise ValueError(f"parameter {rt.name!r} is {tuple(tensors[rt.name].shape)}, "
                                 f"the layout of rank {tp_rank} of {tp_size} says {tuple(rt.shape)}")
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self._repack = [repack for _, repack in unpacked.values()]
        self._sink = Sink(address, timeout=timeout)
        self._sink.register(tensors, layout=layout)
        self._hold = None
        self.version = 0
        self._acquire()
        if self.version:  # applied between registering and holding
            self._repacked()

    def _acquire(self) -> None:
        hold = self._sink.hold()
        self.version = hold.__enter__()
        self._hold = hold

    def _release(self) -> None:
        hold, self._hold = self._hold, None
        if hold is not None:
            hold.__exit__(None, None, None)

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
                self._repacked()
        return self.version

    def _repacked(self) -> None:
        for repack in self._repack:  # the parameters the forward pass reads, from what the sink wrote
            repack()

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


def vllm_rank_sync(model: torch.nn.Module, vllm_config, address: str = DEFAULT_ADDRESS,
                   timeout: float = 60.0) -> RankSync:
    """The RankSync of one vLLM worker: its model's parameters registered in
    place with the sink at `address` (a template, see _address). Refuses,
    naming the setting, an engine whose weights wsync could not keep current:
    pipeline parallelism, sleep mode, CUDA expandable segments, inductor
    freezing, and on CPU parameters vLLM repacked for its GEMM kernels."""
    from vllm.distributed import parallel_state as ps
    if ps.get_pp_group().world_size != 1:
        raise ValueError("wsync's vLLM integration supports tensor and data parallelism, not pipeline parallelism "
                         f"(pipeline_parallel_size={ps.get_pp_group().world_size})")
    check_vllm_memory(model, vllm_config)
    tp = ps.get_tp_group()
    # A dense model's replicas run as independent engines (data_parallel_rank 0 in each);
    # data_parallel_index keeps the replica's rank (vLLM 0.11 and later).
    pc = vllm_config.parallel_config
    dp_rank = int(getattr(pc, "data_parallel_index", None) or getattr(pc, "data_parallel_rank", 0) or 0)
    target = _address(address, tp_rank=tp.rank_in_group, tp_size=tp.world_size, dp_rank=dp_rank)
    config = vllm_config.model_config.hf_config.to_dict()
    # vLLM 0.30 and later name a MoE layer's experts "<block>.experts.routed_experts.w13_weight".
    params = {n.replace(".experts.routed_experts.", ".experts."): p for n, p in model.named_parameters()}
    unpacked = {n: (p.wsync_unpacked[0], functools.partial(_repack_cpu_moe, p))
                for n, p in params.items() if hasattr(p, "wsync_unpacked")}
    return RankSync(params, config, tp.world_size, tp.rank_in_group, target, timeout,
                    layout_args=_vllm_moe_group(model), unpacked=unpacked)


def _repack_cpu_moe(param: torch.Tensor) -> None:
    from .vllm import repack_cpu_moe
    repack_cpu_moe(param)


def _vllm_moe_group(model: torch.nn.Module) -> dict:
    """The MoE group of tp_layout, as vLLM's fused MoE layers were built
    (TP ranks of every DP replica flattened; expert parallel or not)."""
    for module in model.modules():
        manager = getattr(module, "expert_map_manager", None)
        if manager is None:
            continue
        pc = manager.moe_parallel_config
        if getattr(pc, "enable_eplb", False):
            raise ValueError("expert-parallel load balancing (enable_eplb) moves experts between ranks at run time: "
                             "wsync's layouts place them statically. Start the engine without enable_eplb")
        if not pc.use_ep:
            return {"moe_size": pc.tp_size, "moe_rank": pc.tp_rank}
        if getattr(manager, "placement_strategy", "linear") != "linear":
            raise ValueError(f"expert placement {manager.placement_strategy!r}: wsync's layouts place experts "
                             "linearly (expert_placement_strategy='linear')")
        return {"moe_size": pc.ep_size, "moe_rank": pc.ep_rank, "expert_parallel": True}
    return {}


def check_vllm_memory(model: torch.nn.Module, vllm_config) -> None:
    """Raises ValueError naming the vLLM setting that puts the weights where
    wsync cannot write them in place (or makes the forward pass read a copy)."""
    if getattr(vllm_config.model_config, "enable_sleep_mode", False):
        raise ValueError("vLLM's sleep mode (enable_sleep_mode=True) keeps the weights in its own CuMem pool, "
                         "which it releases and re-creates on sleep/wake_up: wsync cannot map it. Start the engine "
                         "without enable_sleep_mode (wsync replaces the reload that sleep mode saves)")
    alloc = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments:true" in alloc.replace(" ", "").lower():
        raise ValueError("PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True: such memory has no CUDA IPC handle "
                         "the sink can open. Start the engine with expandable_segments:False")
    inductor = getattr(vllm_config.compilation_config, "inductor_compile_config", None) or {}
    if inductor.get("freezing") or inductor.get("max_autotune"):
        raise ValueError("inductor freezing (compilation_config inductor_compile_config freezing/max_autotune) "
                         "compiles the weights in as constants: an update would never reach the forward pass. "
                         "Turn it off")
    empty = [n for n, p in model.named_parameters() if p.numel() == 0]
    if empty:
        raise ValueError(f"vLLM left {len(empty)} parameters empty after loading (e.g. {empty[0]!r}): its CPU "
                         "backend repacks linear weights for oneDNN and frees them, so the forward pass reads a "
                         "copy wsync cannot update. Load the wsync plugin (pip install the wsync package; it keeps "
                         "them as parameters when weight_transfer_config backend is 'wsync' or the worker "
                         "extension is wsync's)")


class VllmWorkerExtension:
    """Mixed into each vLLM worker (``worker_extension_cls``); its methods are
    called on every worker with ``LLM.collective_rpc``. For vLLM versions
    without the weight-transfer API; newer ones use the ``wsync`` backend
    (wsync.vllm)."""

    def wsync_register(self, address: str = DEFAULT_ADDRESS, timeout: float = 60.0) -> int:
        """Registers this worker's parameters with the sink at `address`
        (a template: {rank}/{tp_rank}, {tp_size}, {dp_rank}). Returns the
        version held."""
        self.wsync = vllm_rank_sync(self.model_runner.get_model(), self.vllm_config, address, timeout)
        return self.wsync.version

    def wsync_sync(self, version: Optional[int] = None, timeout: float = 60.0) -> int:
        """Brings the parameters to `version` or newer (None: the newest)."""
        return self.wsync.sync(version, timeout)

    def wsync_version(self) -> int:
        return self.wsync.version

    def wsync_close(self) -> None:
        self.wsync.close()


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
        _sglang = RankSync(dict(model.named_parameters()), model.config.to_dict(), size, rank, address)
    _sglang.sync(None if version < 0 else version)
