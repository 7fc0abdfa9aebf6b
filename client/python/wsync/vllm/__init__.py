"""wsync as a vLLM weight-transfer backend, on both sides.

vLLM (0.22 and later) lets an RL framework move weights through a pluggable
engine: ``WeightTransferConfig(backend=...)`` on the inference server, the
four phases ``init_weight_transfer_engine`` / ``start_weight_update`` /
``update_weights`` / ``finish_weight_update`` (methods of ``LLM`` and
``AsyncLLM``, HTTP routes of ``vllm serve``), and a trainer-side engine
driven by ``send_weights()``. Installing the wsync package registers the
``wsync`` backend in every vLLM process (a ``vllm.general_plugins`` entry
point), so a framework that speaks that API switches to wsync by naming it::

    # inference server (each TP rank and DP replica finds its own sink)
    llm = LLM(model=path, tensor_parallel_size=2, weight_transfer_config={"backend": "wsync"})

    # trainer
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from wsync.vllm import LLMClient, WsyncTrainerInitInfo
    engine = WeightTransferTrainerFactory.trainer_init(
        WsyncTrainerInitInfo(rank=0, sink_address="unix:/run/wsync/sink-tp{tp_size}-{tp_rank}.sock"),
        client=LLMClient(llm),            # or vLLM's HTTPVLLMWeightSyncClient / RayVLLMWeightSyncClient
        source=ModuleSource(model))
    for step in ...:
        ...; optimizer.step()
        engine.send_weights()             # publish a patch, every rank applies it between engine steps

What each side does: each worker's engine derives what its parameters hold
from vLLM's own loader (wsync.vllm.loader: any model vLLM loads, no table of
model families) and registers them in place with its ``wsyncd sink``, which
offers that layout to the coordinator; the trainer's engine then registers
the model with its ``wsyncd source``, serving every layout offered, and
publishes a version per ``send_weights``. Each worker's sink (holding
them, so nothing is applied while the engine generates) and, in
``update_weights``, lets the sink apply up to the published version, re-runs
the layers that derive weights from what it wrote (MLA's absorbed
projections), then holds again. ``update_weights`` runs in vLLM's engine loop between model
steps, so no forward pass ever sees part of a version; the ``finish`` of
:class:`LLMClient` resets the prefix cache, whose KV entries the old weights
computed (an ``AsyncLLM`` caller pauses generation with
``pause_generation(clear_cache=True)`` around the update, as for any
backend).

On CPU, vLLM repacks unquantized linear weights for oneDNN after loading and
frees the parameters, so its forward pass reads a copy nothing can update in
place. When the ``wsync`` backend (or wsync's worker extension) is
configured, the plugin keeps those layers on vLLM's plain
``torch.nn.functional.linear`` path, which reads the parameters themselves.
Its MoE kernels have no such path: they read the experts repacked into a
blocked layout; the plugin keeps the experts in the checkpoint's layout
beside them (the experts' size again, on CPU only), the sink writes those,
and every version repacks the parameters from them before the next forward
pass.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from ..checkpoint import CheckpointTensors, checkpoint_tensors
from ..rank_sync import RankSync
from ..source import PublishStats, Source
from .worker import DEFAULT_ADDRESS, VllmWorkerExtension, vllm_rank_sync

BACKEND = "wsync"

__all__ = ["BACKEND", "register", "LLMClient", "VllmWorkerExtension", "WsyncInitInfo", "WsyncUpdateInfo", "WsyncTrainerInitInfo",
           "WsyncWeightTransferEngine", "WsyncTrainerWeightTransferEngine"]

try:
    from vllm.distributed.weight_transfer.base import (TrainerInitInfo, TrainerWeightTransferEngine,
                                                       WeightTransferEngine, WeightTransferInitInfo,
                                                       WeightTransferUpdateInfo)
    HAS_WEIGHT_TRANSFER = True
except ImportError:  # vLLM before the weight-transfer API: wsync.vllm.VllmWorkerExtension
    HAS_WEIGHT_TRANSFER = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point, run in every vLLM process:
    registers the ``wsync`` backend (worker and trainer side) and, on CPU,
    keeps linear weights in place for it. Safe to call more than once.
    Importing this module registers the backend too (a trainer process that
    starts no engine)."""
    _register_engines()
    _keep_cpu_linear_weights()
    _keep_cpu_moe_weights()


def _register_engines() -> None:
    if HAS_WEIGHT_TRANSFER:
        from vllm.distributed.weight_transfer.factory import (WeightTransferEngineFactory,
                                                              WeightTransferTrainerFactory)
        for factory, cls in ((WeightTransferEngineFactory, "WsyncWeightTransferEngine"),
                             (WeightTransferTrainerFactory, "WsyncTrainerWeightTransferEngine")):
            if BACKEND not in factory._registry:
                factory.register_engine(BACKEND, __name__, cls)


def _wsync_configured() -> bool:
    from vllm.config import get_current_vllm_config
    cfg = get_current_vllm_config()
    wt = getattr(cfg, "weight_transfer_config", None)
    if wt is not None and wt.backend == BACKEND:
        return True
    return "wsync" in str(getattr(cfg.parallel_config, "worker_extension_cls", "") or "")


def _keep_cpu_linear_weights() -> None:
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers import utils
    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "wsync", False):
        return

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if weight is None or weight.is_meta or weight.ndim != 2 or not _wsync_configured():
            return original(layer, remove_weight)
        # vLLM's own fallback: F.linear over the parameter the sink writes.
        layer.cpu_linear = torch.nn.functional.linear

    dispatch.wsync = True
    utils.dispatch_cpu_unquantized_gemm = dispatch


def _keep_cpu_moe_weights() -> None:
    """vLLM's CPU MoE kernels read the experts repacked into a blocked
    layout (a permutation, the same size), written over the parameter after
    loading. When wsync is configured, the tensor in the checkpoint's layout
    is kept beside it (``param.wsync_unpacked``: the tensor and the kernel's
    ISA): the sink writes that one, and the parameter is repacked from it
    after every version (wsync.rank_sync.RankSync, from wsync.vllm.worker)."""
    import sys
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return
    from vllm import _custom_ops as ops
    original = getattr(ops, "cpu_prepack_moe_weight", None)
    if original is None or getattr(original, "wsync", False):
        return

    def prepack(weight: torch.Tensor, isa: str) -> torch.Tensor:
        packed = original(weight, isa)
        if _wsync_configured():
            packed.wsync_unpacked = (weight, isa)  # vLLM's replace_parameter carries it to the new parameter
        return packed

    prepack.wsync = True
    ops.cpu_prepack_moe_weight = prepack
    module = sys.modules.get("vllm.model_executor.layers.fused_moe.experts.cpu_moe")
    if module is not None:
        module.cpu_prepack_moe_weight = prepack


class LLMClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over in-process ``LLM``
    engines (each call goes to every engine, in order). ``finish`` also
    resets each engine's prefix cache: its KV entries were computed with the
    old weights."""

    def __init__(self, *llms: Any):
        if not llms:
            raise ValueError("LLMClient needs at least one vllm.LLM")
        self.llms = llms

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        for llm in self.llms:
            llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        for llm in self.llms:
            llm.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        for llm in self.llms:
            llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        for llm in self.llms:
            llm.finish_weight_update(weight_version)
            llm.reset_prefix_cache()


if HAS_WEIGHT_TRANSFER:
    @dataclass
    class WsyncInitInfo(WeightTransferInitInfo):
        """Worker side: where each rank's sink is. `sink_address` is a
        template: {tp_rank} (or {rank}), {tp_size}, {dp_rank}."""
        sink_address: str = DEFAULT_ADDRESS
        timeout: float = 60.0

    @dataclass
    class WsyncUpdateInfo(WeightTransferUpdateInfo):
        """Worker side: the version to hold when update_weights returns (or
        newer; None: the newest the sink knows of)."""
        version: Optional[int] = None
        timeout: float = 60.0

    class WsyncWeightTransferEngine(WeightTransferEngine[WsyncInitInfo, WsyncUpdateInfo]):
        """Worker side: the parameters registered in place with this rank's
        sink and held; update_weights lets the sink apply, then holds."""

        init_info_cls = WsyncInitInfo
        update_info_cls = WsyncUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, config, vllm_config, device, model) -> None:
            super().__init__(config, vllm_config, device, model)
            self.sync: Optional[RankSync] = None

        def init_transfer_engine(self, init_info: WsyncInitInfo) -> None:
            if self.sync is not None:
                self.sync.close()
            self.sync = vllm_rank_sync(self.model, self.vllm_config, init_info.sink_address, init_info.timeout)

        def start_weight_update(self) -> None:
            """Nothing: the sink writes the parameters in place."""

        def finish_weight_update(self) -> None:
            """Nothing: update_weights returns once the version is applied."""

        def receive_weights(self, update_info: WsyncUpdateInfo) -> None:
            if self.sync is None:
                raise RuntimeError("wsync: init_weight_transfer_engine was not called on this worker")
            self.sync.sync(update_info.version, update_info.timeout)

        def shutdown(self) -> None:
            if self.sync is not None:
                self.sync.close()
                self.sync = None

    @dataclass
    class WsyncTrainerInitInfo(TrainerInitInfo):
        """Trainer side. `source_address`: this trainer's wsyncd source;
        `sink_address`: the workers' template (WsyncInitInfo). The engines'
        layouts need no description: each worker derives its own from
        vLLM's loader and its sink offers it to the coordinator; the source
        serves every layout offered when the trainer engine registers it."""
        backend: ClassVar[str] = BACKEND
        source_address: str = "unix:/run/wsync/source.sock"
        sink_address: str = DEFAULT_ADDRESS
        timeout: float = 60.0

    class WsyncTrainerWeightTransferEngine(TrainerWeightTransferEngine[WsyncTrainerInitInfo]):
        """Trainer side: the model registered with the trainer's source
        (in place for a ModuleSource of plain tensors; other WeightSources,
        FSDP's say, are copied into registered buffers each round), one
        version published per send_weights, and every worker brought to it."""

        init_info_cls = WsyncTrainerInitInfo

        def __init__(self, *, client, source=None, is_sender: bool = True) -> None:
            super().__init__(client=client, source=source, is_sender=is_sender)
            self.wsync: Optional[Source] = None
            self._buffers: Optional[dict] = None
            self._checkpoint: Optional[CheckpointTensors] = None
            self.timeout = 60.0
            self.last: Optional[PublishStats] = None

        @classmethod
        def trainer_init(cls, init_info: WsyncTrainerInitInfo, *, client, source=None):
            """Initializes the workers' engines first (each derives its
            layout from vLLM's loader and registers with its sink, which
            offers it), then registers the model with the trainer's source,
            serving every layout offered. Engines that hold FP8 weights
            (wsync.vllm.fp8) name the codes and scales they hold in the
            layouts they offer: the source quantizes those with vLLM's own
            functions and publishes them beside the model's tensors
            (wsync.quantized)."""
            if source is None:
                raise ValueError("the wsync trainer engine needs the model: source=ModuleSource(model)")
            engine = cls(client=client, source=source, is_sender=init_info.is_sender)
            engine.timeout = init_info.timeout
            module = getattr(source, "_module", None)
            in_place = module is not None and not any(hasattr(p, "full_tensor") for _, p in module.named_parameters())
            if not in_place:
                # Every rank iterates (materializing may be collective); the sender keeps the bytes.
                engine._buffers = {m.name: torch.empty(m.shape, dtype=m.dtype) for m in source.metadata()} \
                    if engine.is_sender else {}
                engine._copy_in()
            if not engine.is_sender:
                return engine
            if in_place:
                # The checkpoint's tensors (one per expert), as views of the module's where they can be.
                engine._checkpoint = checkpoint_tensors(module)
                tensors = engine._checkpoint.tensors
            else:
                tensors = engine._buffers
            client.init_weight_transfer_engine(dataclasses.asdict(
                WsyncInitInfo(sink_address=init_info.sink_address, timeout=init_info.timeout)))
            engine.wsync = Source(init_info.source_address, timeout=init_info.timeout)
            engine.wsync.register(tensors, serve_offered=True)
            return engine

        def _copy_in(self) -> None:
            with torch.no_grad():
                for name, tensor in self.source:
                    if name in self._buffers and tensor is not None:
                        self._buffers[name].copy_(tensor)

        def send_weights(self, version: Optional[int] = None) -> Optional[PublishStats]:
            """Publishes the model's current weights (as `version`, default the
            next) and brings every worker to that version. Returns the
            publish's figures (None on ranks other than the sender)."""
            if self._buffers is not None:
                self._copy_in()  # every rank: materializing may be collective
            if not self.is_sender:
                return None
            if self._checkpoint is not None:
                self._checkpoint.refresh()
            assert self.wsync is not None
            self.last = self.wsync.publish(version)
            self.client.start_weight_update()
            self.client.update_weights(dataclasses.asdict(WsyncUpdateInfo(self.last.version, self.timeout)))
            self.client.finish_weight_update(str(self.last.version))
            return self.last

        def shutdown(self) -> None:
            if self.wsync is not None:
                self.wsync.close()
                self.wsync = None


_register_engines()
