"""A vLLM worker's side: its parameters registered in place with its sink,
laid out as vLLM's own loader lays them out (wsync.vllm.loader), and the
layers that derive weights from them re-run after every version."""
from __future__ import annotations

import functools
import logging
import os
import time
from typing import Optional

import torch

from ..errors import FailedPreconditionError
from ..rank_sync import RankSync, rank_address
from .fp8 import SCHEMES, checkpoint_format, quantized_layers, quantized_layout
from .loader import LoaderLayout, checkpoint_shapes, derive_layout

__all__ = ["DEFAULT_ADDRESS", "VllmWorkerExtension", "check_vllm_memory", "check_vllm_quantization",
           "rank_layout", "vllm_rank_sync"]

DEFAULT_ADDRESS = "unix:/run/wsync/sink-{rank}.sock"
log = logging.getLogger("wsync.vllm")


def rank_layout(model: torch.nn.Module, vllm_config, checkpoint=None, formats=None) -> LoaderLayout:
    """This rank's layout, from vLLM's loader over the checkpoint it loaded
    (`formats`: wsync.vllm.loader.derive_layout's)."""
    start = time.perf_counter()
    layout = derive_layout(model, checkpoint if checkpoint is not None else checkpoint_shapes(vllm_config),
                           formats=formats)
    log.info("wsync: layout of %d runtime tensors derived from vLLM's loader in %.2f s (%d derived layers, "
             "%d constant parameters)", len(layout.tensors), time.perf_counter() - start, len(layout.derived),
             len(layout.constants))
    return layout


def vllm_rank_sync(model: torch.nn.Module, vllm_config, address: str = DEFAULT_ADDRESS,
                   timeout: float = 60.0) -> RankSync:
    """The RankSync of one vLLM worker: its model's parameters registered in
    place with the sink at `address` (a template with {rank}/{tp_rank},
    {tp_size}, {dp_rank}), laid out as vLLM's loader places the checkpoint
    (the sink offers that layout to the coordinator, for the source to
    serve). An engine with vLLM's online FP8 (per tensor, channel or block) holds
    its quantized layers' codes and scales, which the sink writes
    (wsync.vllm.fp8).
    Refuses, naming the setting, an engine whose weights wsync could not
    keep exact: pipeline parallelism, quantization other than that, expert
    load balancing, sleep mode, CUDA expandable segments, inductor freezing,
    on CPU parameters vLLM repacked for its GEMM kernels, and parameters the
    loader writes other than as copies of the checkpoint."""
    from vllm.distributed import parallel_state as ps
    if ps.get_pp_group().world_size != 1:
        raise ValueError("wsync's vLLM integration supports tensor, data and expert parallelism, not pipeline "
                         f"parallelism (pipeline_parallel_size={ps.get_pp_group().world_size})")
    check_vllm_quantization(vllm_config)
    layers = quantized_layers(model)
    if layers and vllm_config.model_config.dtype != torch.bfloat16:
        raise ValueError(f"an FP8 engine of dtype {vllm_config.model_config.dtype}: wsync's FP8 codes are quantized "
                         "from the published BF16 weights, as vLLM quantizes them in a BF16 engine (dtype='bfloat16')")
    check_vllm_memory(model, vllm_config)
    _check_moe(model)
    tp = ps.get_tp_group()
    # A dense model's replicas run as independent engines (data_parallel_rank 0 in each);
    # data_parallel_index keeps the replica's rank (vLLM 0.11 and later).
    pc = vllm_config.parallel_config
    dp_rank = int(getattr(pc, "data_parallel_index", None) or getattr(pc, "data_parallel_rank", 0) or 0)
    target = rank_address(address, tp_rank=tp.rank_in_group, tp_size=tp.world_size, dp_rank=dp_rank)
    checkpoint = checkpoint_shapes(vllm_config)
    layout = rank_layout(model, vllm_config, checkpoint, formats=checkpoint_format(model, layers))
    params = dict(model.named_parameters())
    unpacked = {n: (p.wsync_unpacked[0], functools.partial(_repack_cpu_moe, p))
                for n, p in params.items() if hasattr(p, "wsync_unpacked")}
    tensors, written = quantized_layout(model, layout.tensors, layers, {n: s for n, (s, _) in checkpoint.items()})
    unpacked.update(_widened(params, [rt for rt in tensors if rt.name.partition("[")[0] not in written], checkpoint))
    act_dtype = vllm_config.model_config.dtype
    derived = [functools.partial(d.recompute, act_dtype) for d in layout.derived]
    try:
        return RankSync({**params, **written}, tensors, target, timeout, unpacked=unpacked, after_version=derived,
                        what=f"rank {tp.rank_in_group} of {tp.world_size}")
    except FailedPreconditionError as e:
        if layers and "no such tensor" in str(e) and any(f"'{s}:" in str(e) for s in SCHEMES):
            raise FailedPreconditionError(
                f"{e} -- the trainer's source publishes no FP8 codes: it registered before this FP8 engine offered "
                "its layout, and the tensors a run publishes are fixed by its first registration. Start the FP8 "
                "engines before the trainer registers (its trainer_init initializes the engines it is given first), "
                "or start a new run", e.code, e.reason, e.metadata) from e
        raise


def _published_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a source publishes a tensor of `dtype` in (F32 as BF16)."""
    return torch.bfloat16 if dtype == torch.float32 else dtype


def _widened(params, tensors, checkpoint) -> dict:
    """Parameters the engine keeps in a wider dtype than the published
    tensors they hold (a router's bias correction in F32, say): the sink
    writes a copy in the published dtype, and every version widens it into
    the parameter (exact, as vLLM's loader's own copy). Raises ValueError
    for a parameter holding tensors of several published dtypes."""
    out = {}
    for rt in tensors:
        name = rt.name.partition("[")[0]
        dtypes = {_published_dtype(checkpoint[p.canonical][1]) for p in rt.pieces}
        if len(dtypes) != 1:
            raise ValueError(f"parameter {name!r} holds checkpoint tensors of several dtypes {sorted(map(str, dtypes))}")
        dtype, param = dtypes.pop(), params[name]
        if param.dtype == dtype or name in out:
            continue
        if param.dtype.itemsize < dtype.itemsize or not param.dtype.is_floating_point:
            raise ValueError(f"parameter {name!r} is {param.dtype}, narrower than the {dtype} published for it: "
                             "writing it would not keep the engine exact")
        shadow = param.detach().to(dtype).clone()
        out[name] = (shadow, functools.partial(_widen, param, shadow))
    return out


def _widen(param: torch.Tensor, shadow: torch.Tensor) -> None:
    with torch.no_grad():
        param.data.copy_(shadow)


def _repack_cpu_moe(param: torch.Tensor) -> None:
    unpacked, isa = param.wsync_unpacked
    torch.ops._C.prepack_moe_weight(unpacked, param.data, isa)


def check_vllm_quantization(vllm_config) -> None:
    """Raises ValueError naming the quantization unless it is vLLM's online
    FP8 quantization of a BF16 checkpoint ('fp8_per_tensor', 'fp8_per_channel',
    'fp8_per_block', 'fp8', or 'online' with a quantization_config), whose
    layers wsync.vllm.fp8 then checks one by one (an FP8 checkpoint, also
    'fp8', is refused there): wsync writes what the parameters hold, which
    for any other quantization it does not reproduce exactly."""
    quantization = getattr(vllm_config.model_config, "quantization", None)
    if quantization and quantization not in (*SCHEMES, "fp8", "online"):
        raise ValueError(f"the engine is quantized (quantization={quantization!r}): wsync keeps BF16 and FP16 "
                         "engines exact, and FP8 engines that quantize a BF16 checkpoint per tensor, per channel or "
                         "per 128x128 block (quantization='fp8_per_tensor', 'fp8_per_channel' or 'fp8_per_block'); "
                         "start the engine without quantization or with one of those")


def _check_moe(model: torch.nn.Module) -> None:
    """Expert-parallel load balancing moves experts between ranks at run
    time: a layout read at registration would go stale."""
    for module in model.modules():
        manager = getattr(module, "expert_map_manager", None)
        if manager is not None and getattr(manager.moe_parallel_config, "enable_eplb", False):
            raise ValueError("expert-parallel load balancing (enable_eplb) moves experts between ranks at run time: "
                             "wsync's layouts place them as loaded. Start the engine without enable_eplb")


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
    without the weight-transfer API; newer ones use the ``wsync`` backend."""

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
