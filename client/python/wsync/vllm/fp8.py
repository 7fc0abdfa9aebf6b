"""FP8 engines: vLLM's online per-channel FP8 (``quantization="fp8_per_channel"``)
kept bit-identical to vLLM's own FP8 load of every version.

Such an engine holds, for every quantized linear layer, E4M3 codes (its
``weight``: an (N, K) buffer that vLLM exposes transposed, as (K, N)) and one
F32 scale per output row (``weight_scale``, (N, 1)), both computed by vLLM
from the BF16 checkpoint after loading. wsync ships those, not BF16 values
(docs/fp8.md has the measurements behind that choice): the trainer quantizes
its weights with vLLM's own functions and publishes, beside the BF16 tensors,

- ``"fp8_per_channel:<name>"``: the codes of checkpoint tensor ``<name>``
  (F8_E4M3, its shape);
- ``"fp8_per_channel:<name>_scale"``: its row scales, (N, 1), as the bit
  patterns of their F32 values (I32, which the source never rounds: it
  publishes F32 tensors as BF16),

and each worker's sink writes them into the codes and scales in place.
Per-channel quantization is row by row: vLLM all-reduces a row's amax over
the tensor-parallel ranks when it splits the row (row-parallel layers), and
a fused layer stacks whole rows (``qkv_proj``, ``gate_up_proj``). So the
codes a rank holds are the rows and columns of the checkpoint tensors' codes
that vLLM's loader places in the BF16 weight, and its scales the same rows.

This module is the worker's side: :func:`quantized_layout` derives that
layout from vLLM's loader run over each quantized layer's checkpoint-format
parameter (what vLLM records to reload weights). The trainer's side is
wsync.quantized, which wsync.Source runs for whatever the sinks offer.
"""
from __future__ import annotations

import types
from typing import Dict, Iterable, List, Mapping, Sequence, Tuple

import torch

from ..layouts import Piece, RuntimeTensor
from ..quantized import PER_CHANNEL, codes_name, scale_name

__all__ = ["PER_CHANNEL", "checkpoint_format", "quantized_layers", "quantized_layout"]

_LINEAR_METHODS = {"Fp8PtpcOnlineLinearMethod": PER_CHANNEL}
_UNQUANTIZED = {"UnquantizedLinearMethod", "UnquantizedFusedMoEMethod", "UnquantizedEmbeddingMethod"}



def quantized_layers(model: torch.nn.Module) -> Dict[str, str]:
    """The layers whose weights vLLM quantized, by module name: the scheme.
    Raises ValueError naming a layer quantized in a way wsync does not keep
    exact (another FP8 mode, MoE experts, INT8, FP4): its weights would be
    stale, never approximated."""
    out, refused = {}, []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or any(c.__name__ in _UNQUANTIZED for c in type(method).__mro__):
            continue  # vLLM's unquantized methods, and the model-specific ones derived from them
        kind = type(method).__name__
        if kind in _LINEAR_METHODS:
            out[name] = _LINEAR_METHODS[kind]
        elif any(hasattr(module, p) for p in ("weight", "w13_weight", "w2_weight", "qweight")):
            refused.append(f"{name} ({kind})")
    if refused:
        raise ValueError(f"{len(refused)} layer(s) are quantized by a method wsync does not keep exact, e.g. "
                         f"{refused[0]}: wsync keeps BF16 engines and vLLM's online per-channel FP8 linear layers "
                         "(quantization='fp8_per_channel', its MoE experts excepted) bit-identical to a fresh load")
    return out


def checkpoint_format(model: torch.nn.Module, layers: Iterable[str]) -> Dict[str, torch.Tensor]:
    """The ``weight`` each quantized layer had before vLLM quantized it (the
    checkpoint's format: BF16, (N, K), its weight loader), on the meta
    device, by parameter name: what vLLM recorded to reload weights, for
    wsync.vllm.loader.derive_layout to run vLLM's loader over."""
    if not layers:
        return {}
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    modules = dict(model.named_modules())
    out = {}
    for name in layers:
        module = modules[name]
        info = LAYERWISE_INFO.get(module)
        recorded = info.restore_metadata[0].get("weight") if info is not None else None
        if recorded is None:
            raise ValueError(f"vLLM recorded no checkpoint-format weight for {name!r}: wsync cannot tell which "
                             "checkpoint rows its FP8 codes hold")
        twin = torch.nn.Parameter(torch.empty(recorded.shape, dtype=recorded.dtype, device="meta"),
                                  requires_grad=False)
        twin.__class__ = type(recorded)
        twin.__dict__.update(recorded.__dict__)
        twin.weight_loader = _bound_loader(twin.weight_loader, module)
        out[f"{name}.weight" if name else "weight"] = twin
    return out


def _bound_loader(loader, module: torch.nn.Module):
    """The loader vLLM's online quantization wrapped, bound to its layer
    again (vLLM records it unbound from the layer, to hold no reference)."""
    while getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    if isinstance(loader, types.MethodType) and not isinstance(loader.__self__, torch.nn.Module):
        loader = loader.__func__.__get__(module)
    return loader


def quantized_layout(model: torch.nn.Module, tensors: Sequence[RuntimeTensor], layers: Mapping[str, str]
                     ) -> Tuple[List[RuntimeTensor], Dict[str, torch.Tensor]]:
    """This rank's runtime tensors with each quantized layer's BF16 weight
    (as vLLM's loader places the checkpoint, `tensors`) replaced by its
    codes and its scales, and the tensors the sink writes for them: the
    codes' (N, K) buffer and the scales' bits. Raises ValueError when the
    engine's kernel left the codes or scales in another layout."""
    params = dict(model.named_parameters())
    weights = {(f"{n}.weight" if n else "weight"): s for n, s in layers.items()}
    out, targets = [], {}
    for rt in tensors:
        scheme = weights.get(rt.name)
        if scheme is None:
            out.append(rt)
            continue
        layer = rt.name[:-len("weight")]
        codes, scales = params[rt.name], params.get(layer + "weight_scale")
        n, k = rt.shape
        if codes.dtype != torch.float8_e4m3fn or tuple(codes.shape) != (k, n) or not codes.t().is_contiguous():
            raise ValueError(f"{rt.name!r} is {codes.dtype} {tuple(codes.shape)} with strides {codes.stride()}: "
                             f"vLLM's FP8 kernel keeps per-channel codes as an ({n}, {k}) E4M3 buffer seen "
                             "transposed, which wsync writes; this kernel repacked them")
        if scales is None or scales.dtype != torch.float32 or tuple(scales.shape) != (n, 1) \
                or not scales.is_contiguous():
            raise ValueError(f"{layer + 'weight_scale'!r} is not the ({n}, 1) F32 row scales of per-channel FP8")
        rows = dict.fromkeys((p.canonical, p.start[0], p.extent[0], p.at[0]) for p in rt.pieces)
        spans = sorted((a, a + e, c) for c, _, e, a in rows)
        for (a0, a1, c0), (b0, _, c1) in zip(spans, spans[1:]):
            if b0 < a1:
                raise ValueError(f"{rt.name!r} holds rows of {c0!r} and {c1!r} side by side: a row's FP8 scale spans "
                                 "both, which quantizing each checkpoint tensor on its own cannot give")
        out.append(RuntimeTensor(rt.name, rt.shape, tuple(Piece(codes_name(scheme, p.canonical), p.start, p.extent,
                                                                p.at) for p in rt.pieces)))
        scale_rt = layer + "weight_scale"
        out.append(RuntimeTensor(scale_rt, (n, 1), tuple(
            Piece(scale_name(scheme, c), (r, 0), (e, 1), (a, 0)) for c, r, e, a in rows)))
        targets[rt.name] = codes.t()  # a view of the Parameter: the Parameter moves, strides kept
        bits = scales.view(torch.int32)
        bits.wsync_owner = scales  # torch does not link a dtype view to its base
        targets[scale_rt] = bits
    return out, targets
