"""wsync in SGLang (SGLang 0.4.8 and later): each tensor-parallel worker's
parameters kept by its sink through SGLang's custom weight loader::

    engine = sglang.Engine(model_path=path, tp_size=4,
                           custom_weight_loader=["wsync.sglang.load"])
    # each rank's sink address: WSYNC_SINK_ADDRESS (a template with {rank}),
    # default unix:/run/wsync/sink-{rank}.sock
    ...                                              # generate
    engine.update_weights_from_tensor(wsync.sglang.request(step),
                                      load_format="wsync.sglang.load")

The first call registers the worker's parameters with the layout
:func:`wsync.layouts.tp_layout` gives for the model's config (the families it
knows; the trainer's source must serve those layouts); every call syncs to
the version in the request. SGLang does not run where wsync is tested: this
module runs against a stand-in of SGLang's parallel state
(tests/python/engines_test.py), and the sink it drives against real sinks
(tests/python/client_test.py tensor_parallel).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from ..layouts import tp_layout
from ..rank_sync import RankSync, rank_address

__all__ = ["load", "request"]

DEFAULT_ADDRESS = "unix:/run/wsync/sink-{rank}.sock"
_VERSION = "wsync.version"
_rank: Optional[RankSync] = None


def request(version: Optional[int] = None) -> list:
    """The `named_tensors` of ``Engine.update_weights_from_tensor`` that make
    every rank's :func:`load` sync to `version` (None: the newest)."""
    return [(_VERSION, torch.tensor([-1 if version is None else int(version)], dtype=torch.int64))]


def load(model: torch.nn.Module, named_tensors) -> None:
    """SGLang's custom weight loader, run in each tensor-parallel worker: the
    first call registers the worker's parameters with its sink, every call
    syncs to the version in the request (:func:`request`)."""
    global _rank
    req = dict(named_tensors)
    if set(req) != {_VERSION}:
        raise ValueError(f"wsync.sglang.load takes wsync.sglang.request(version), not {sorted(req)[:3]}")
    version = int(req[_VERSION].reshape(-1)[0].item())
    if _rank is None:
        from sglang.srt.distributed import parallel_state as ps
        rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        address = rank_address(os.environ.get("WSYNC_SINK_ADDRESS", DEFAULT_ADDRESS), tp_rank=rank, tp_size=size,
                               dp_rank=0)
        _rank = RankSync(dict(model.named_parameters()), tp_layout(model.config.to_dict(), size, rank), address,
                         what=f"rank {rank} of {size}")
    _rank.sync(None if version < 0 else version)
