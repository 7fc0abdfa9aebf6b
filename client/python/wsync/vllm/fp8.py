"""FP8 engines: vLLM's online FP8 per tensor (``quantization="fp8_per_tensor"``),
per channel (``"fp8_per_channel"``) and per 128x128 block (``"fp8_per_block"``)
kept bit-identical to vLLM's own FP8 load of every version.

Such an engine holds, for every quantized linear layer, E4M3 codes and F32
scales computed by vLLM from the BF16 checkpoint after loading:

- per tensor: ``weight``, an (N, K) buffer that vLLM exposes transposed, as
  (K, N), and one scale for the whole fused layer (``weight_scale``, (1,)),
  from the amax of all of it (all-reduced over the ranks);
- per channel: ``weight`` as per tensor, and one scale per output row
  (``weight_scale``, (N, 1));
- per block: ``weight``, (N, K), and one dequantization scale per 128x128
  block (``weight_scale_inv``, (ceil(N/128), ceil(K/128))).

wsync ships those, not BF16 values (docs/fp8.md has the measurements behind
that choice): the trainer quantizes its weights with vLLM's own functions
and publishes, beside the BF16 tensors, the codes and scales of each
checkpoint tensor (wsync.quantized names them), and each worker's sink
writes them into the codes and scales in place.

A unit (row or block) is quantized on its own once its scale is known.
vLLM all-reduces a row's amax over the tensor-parallel ranks when it splits
the row (row-parallel layers), and a fused layer stacks whole rows
(``qkv_proj``, ``gate_up_proj``); blocks are the rank's own, so they are
the checkpoint tensor's blocks where every piece the loader places starts
on a block boundary and ends on one or at the tensor's end in both. Then
the codes a rank holds are the rows and columns of the checkpoint tensors'
codes that vLLM's loader places in the BF16 weight, and its scales the
same rows (or blocks). A layout where a unit would span two checkpoint
tensors (or part of one) is refused, naming the layer.

This module is the worker's side: :func:`quantized_layout` derives that
layout from vLLM's loader run over each quantized layer's checkpoint-format
parameter (what vLLM records to reload weights). The trainer's side is
wsync.quantized, which wsync.Source runs for whatever the sinks offer.
"""
from __future__ import annotations

import types
from typing import Dict, Iterable, List, Mapping, Sequence, Tuple

import torch

from ..layouts import Piece, RuntimeTensor, runtime_tensor
from ..quantized import BLOCK, PER_BLOCK, PER_CHANNEL, PER_TENSOR, codes_name, group_name, scale_name, scale_shape

__all__ = ["PER_BLOCK", "PER_CHANNEL", "PER_TENSOR", "SCHEMES", "checkpoint_format", "quantized_layers",
           "quantized_layout"]

_LINEAR_METHODS = {"Fp8PerTensorOnlineLinearMethod": PER_TENSOR, "Fp8PtpcOnlineLinearMethod": PER_CHANNEL,
                   "Fp8PerBlockOnlineLinearMethod": PER_BLOCK}
# MoE experts: per 128x128 block of each expert's gate, up and down projections (its w13_weight[e] and
# w2_weight[e], as the loader places them).
_MOE_METHODS = {"Fp8PerBlockOnlineMoEMethod": PER_BLOCK}
# A checkpoint already in FP8 with 128x128 block scales (DeepSeek's format: `weight` in E4M3 and
# `weight_scale_inv`), loaded as stored: the same codes and scales as online per-block quantization
# when the checkpoint was quantized by vLLM's per_block_cast_to_fp8.
_CHECKPOINT_METHOD = "Fp8LinearMethod"
SCHEMES = tuple(_LINEAR_METHODS.values())  # the quantization= settings wsync keeps exact
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
        if kind in _LINEAR_METHODS or kind in _MOE_METHODS:
            out[name] = _LINEAR_METHODS.get(kind) or _MOE_METHODS[kind]
        elif kind == _CHECKPOINT_METHOD and list(getattr(method, "weight_block_size", None) or []) == [BLOCK, BLOCK]:
            out[name] = PER_BLOCK
        elif kind == _CHECKPOINT_METHOD:
            refused.append(f"{name} ({kind}, an FP8 checkpoint with blocks "
                           f"{getattr(method, 'weight_block_size', None)}, not {BLOCK}x{BLOCK})")
        elif any(hasattr(module, p) for p in ("weight", "w13_weight", "w2_weight", "qweight")):
            refused.append(f"{name} ({kind})")
    if refused:
        shown = "; ".join(refused[:3]) + ("; ..." if len(refused) > 3 else "")
        raise ValueError(f"{len(refused)} layer(s) are quantized by a method wsync does not keep exact ({shown}): "
                         "wsync keeps BF16 engines, vLLM's online FP8 linear layers (quantization='fp8_per_tensor', "
                         "'fp8_per_channel' or 'fp8_per_block' on a BF16 checkpoint), MoE experts per block "
                         "('fp8_per_block') and checkpoints in FP8 with 128x128 block scales bit-identical to a fresh "
                         "load")
    return out


def _quantized_params(module: torch.nn.Module) -> Tuple[str, ...]:
    """The parameters of a quantized layer that hold its codes."""
    return ("w13_weight", "w2_weight") if type(module.quant_method).__name__ in _MOE_METHODS else ("weight",)


def _loaded_params(module: torch.nn.Module) -> Tuple[str, ...]:
    """The parameters of a quantized layer vLLM's loader writes from the
    checkpoint: its codes' (online quantization loads them in BF16), and
    an FP8 checkpoint's block scales."""
    scales = ("weight_scale_inv",) if type(module.quant_method).__name__ == _CHECKPOINT_METHOD else ()
    return _quantized_params(module) + scales


def _joined(layer: str, param: str) -> str:
    return f"{layer}.{param}" if layer else param


def checkpoint_format(model: torch.nn.Module, layers: Iterable[str]) -> Dict[str, torch.Tensor]:
    """The weights each quantized layer had before vLLM quantized them (the
    checkpoint's format: BF16, (N, K) or (experts, N, K), their weight
    loader), on the meta device, by parameter name: what vLLM recorded to
    reload weights, for wsync.vllm.loader.derive_layout to run vLLM's loader
    over."""
    if not layers:
        return {}
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    modules = dict(model.named_modules())
    out = {}
    for name in layers:
        module = modules[name]
        info = LAYERWISE_INFO.get(module)
        for param in _loaded_params(module):
            recorded = info.restore_metadata[0].get(param) if info is not None else None
            if recorded is None:
                raise ValueError(f"vLLM recorded no checkpoint-format {param} for {name!r}: wsync cannot tell which "
                                 "checkpoint rows its FP8 codes hold")
            twin = torch.nn.Parameter(torch.empty(recorded.shape, dtype=recorded.dtype, device="meta"),
                                      requires_grad=False)
            twin.__class__ = type(recorded)
            twin.__dict__.update(recorded.__dict__)
            twin.weight_loader = _bound_loader(twin.weight_loader, module)
            out[_joined(name, param)] = twin
    return out


def _bound_loader(loader, module: torch.nn.Module):
    """The loader vLLM's online quantization wrapped, bound to its layer
    again (vLLM records it unbound from the layer, to hold no reference)."""
    while getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    if isinstance(loader, types.MethodType) and not isinstance(loader.__self__, torch.nn.Module):
        loader = loader.__func__.__get__(module)
    return loader


def quantized_layout(model: torch.nn.Module, tensors: Sequence[RuntimeTensor], layers: Mapping[str, str],
                     checkpoint: Mapping[str, Sequence[int]] = {}
                     ) -> Tuple[List[RuntimeTensor], Dict[str, torch.Tensor]]:
    """This rank's runtime tensors with each quantized layer's weight (as
    vLLM's loader places the checkpoint, `tensors`: a BF16 weight, one
    expert's ``w13_weight[e]`` or ``w2_weight[e]``, an FP8 checkpoint's
    codes) replaced by its codes and its scales, and the tensors the sink
    writes for them: the codes' (N, K) buffer and the scales' bits.
    `checkpoint`: the shape of each checkpoint tensor (where its last block
    ends), for blocks. Raises ValueError when the engine's kernel left the
    codes or scales in another layout, or when a row or block would span two
    checkpoint tensors."""
    params, modules = dict(model.named_parameters()), dict(model.named_modules())
    weights = {_joined(n, param): (n, s) for n, s in layers.items() for param in _quantized_params(modules[n])}
    # An FP8 checkpoint's block scales as loaded: replaced by the scales of each piece's blocks below.
    loaded = {_joined(n, p) for n in layers for p in _loaded_params(modules[n])} - set(weights)
    for name in layers:
        _check_kernel(name, modules[name])
    out, targets = [], {}
    for rt in tensors:
        base, _, expert = rt.name.partition("[")  # "<parameter>[e]": one expert of a fused MoE parameter
        expert = f"[{expert}" if expert else ""
        if base in loaded:
            continue
        if base not in weights:
            out.append(rt)
            continue
        name, scheme = weights[base]
        n, k = rt.shape
        scale_param = base + _SCALE_SUFFIX[scheme]
        codes, scales = runtime_tensor(params, rt.name), params.get(scale_param)
        scales = scales[int(expert[1:-1])] if scales is not None and expert else scales
        group = ""
        if scheme in (PER_CHANNEL, PER_TENSOR):
            fits, held = tuple(codes.shape) == (k, n) and codes.t().is_contiguous(), "seen transposed"
            if scheme == PER_CHANNEL:
                units = _row_units(rt)
            else:
                group = _tensor_group(rt, modules[name], checkpoint)
                units = [(group, (0,), (1,), (0,))]
        else:
            fits, held = tuple(codes.shape) == (n, k) and codes.is_contiguous(), "contiguous"
            units = _block_units(rt, checkpoint)
        if codes.dtype != torch.float8_e4m3fn or not fits:
            raise ValueError(f"{rt.name!r} is {codes.dtype} {tuple(codes.shape)} with strides {codes.stride()}: "
                             f"vLLM's FP8 kernel keeps {scheme} codes as an ({n}, {k}) E4M3 buffer {held}, which "
                             "wsync writes; this kernel repacked them")
        want = scale_shape(scheme, (n, k))
        if scales is None or scales.dtype != torch.float32 or tuple(scales.shape) != want \
                or not scales.is_contiguous():
            raise ValueError(f"{scale_param + expert!r} is not the {want} F32 scales of {scheme} FP8 (it is "
                             f"{None if scales is None else (scales.dtype, tuple(scales.shape), scales.stride())}): "
                             "this kernel keeps them in another layout, which wsync does not write")
        out.append(RuntimeTensor(rt.name, rt.shape, tuple(Piece(codes_name(scheme, p.canonical, group), p.start,
                                                                p.extent, p.at) for p in rt.pieces)))
        out.append(RuntimeTensor(scale_param + expert, want, tuple(Piece(scale_name(scheme, c), start, extent, at)
                                                                   for c, start, extent, at in units)))
        # The Parameters (the sink resolves an expert's slice); per channel and tensor the codes' (N, K)
        # buffer, a view of the Parameter: it moves, strides kept.
        whole = params[base]
        targets[base] = whole.t() if scheme in (PER_CHANNEL, PER_TENSOR) else whole
        bits = params[scale_param].view(torch.int32)
        bits.wsync_owner = params[scale_param]  # torch does not link a dtype view to its base
        targets[scale_param] = bits
    return out, targets


# The kernels' weight processing (after the method quantized) that leaves the codes and scales as the
# method computed them, by the class that defines it: none (FP8ScaledMMLinearKernel), E4M3FNUZ
# normalization only, which the codes' dtype check refuses (Fp8BlockScaledMMLinearKernel), padding to
# multiples of 16, which the shape check refuses (CutlassFP8ScaledMMLinearKernel). Others rewrite them in
# place (DeepGEMM's UE8M0 requantization and scale layout, Marlin's repacking, AMX's VNNI packing).
_KEEPING_KERNELS = ("FP8ScaledMMLinearKernel", "Fp8BlockScaledMMLinearKernel", "CutlassFP8ScaledMMLinearKernel")


# FP8 MoE backends whose load-time format is the method's own (vLLM's convert_to_fp8_moe_kernel_format
# leaves their weights and scales as quantized), with experts that do not process them further.
_KEEPING_MOE_BACKENDS = ("TRITON", "BATCHED_TRITON", "VLLM_CUTLASS", "BATCHED_VLLM_CUTLASS")


def _check_kernel(name: str, layer: torch.nn.Module) -> None:
    """Raises ValueError naming the layer's FP8 kernel when it processes the
    weights after vLLM's method quantized them: the codes and scales would
    then be the kernel's, not those of vLLM's quantization functions the
    trainer runs, and could differ in value at the same shape."""
    method = getattr(layer, "quant_method", None)
    if type(method).__name__ in _MOE_METHODS:
        backend = getattr(getattr(method, "fp8_backend", None), "value", None)
        experts = getattr(method, "experts_cls", None)
        owner = next((c for c in getattr(experts, "__mro__", ()) if "process_weights_after_loading" in c.__dict__),
                     None)
        if backend in _KEEPING_MOE_BACKENDS and getattr(owner, "__name__", None) == "FusedMoEExperts":
            return
        raise ValueError(f"{name!r} runs vLLM's FP8 MoE backend {backend} with experts "
                         f"{getattr(experts, '__name__', None)}, which convert or process the experts' weights "
                         "after quantizing them (shuffles, repacking, UE8M0 scales): wsync writes what vLLM's "
                         "quantization functions compute and would not keep them exact. wsync keeps the backends "
                         f"that leave them as quantized ({', '.join(_KEEPING_MOE_BACKENDS)})")
    kernel = getattr(method, "fp8_linear", None)
    owner = next((c for c in type(kernel).__mro__ if "process_weights_after_loading" in c.__dict__), None)
    if kernel is None or owner is None or owner.__name__ not in _KEEPING_KERNELS:
        raise ValueError(f"{name!r} runs vLLM's FP8 kernel {type(kernel).__name__}, which processes the weights after "
                         f"quantizing them ({getattr(owner, '__name__', '?')}.process_weights_after_loading): wsync "
                         "writes what vLLM's quantization functions compute and would not keep it exact. Start the "
                         "engine with a kernel that leaves them as quantized (for 128x128 blocks on CUDA, "
                         "VLLM_USE_DEEP_GEMM=0 leaves DeepGEMM out)")


_SCALE_SUFFIX = {PER_TENSOR: "_scale", PER_CHANNEL: "_scale", PER_BLOCK: "_scale_inv"}


def _row_units(rt: RuntimeTensor) -> List[tuple]:
    """The row scales' pieces of a per-channel layer: the rows its pieces
    hold, whole (a row-parallel layer's pieces split them by columns)."""
    rows = dict.fromkeys((p.canonical, p.start[0], p.extent[0], p.at[0]) for p in rt.pieces)
    spans = sorted((a, a + e, c) for c, _, e, a in rows)
    for (a0, a1, c0), (b0, _, c1) in zip(spans, spans[1:]):
        if b0 < a1:
            raise ValueError(f"{rt.name!r} holds rows of {c0!r} and {c1!r} side by side: a row's FP8 scale spans "
                             "both, which quantizing each checkpoint tensor on its own cannot give")
    return [(c, (r, 0), (e, 1), (a, 0)) for c, r, e, a in rows]


def _tensor_group(rt: RuntimeTensor, layer: torch.nn.Module, checkpoint: Mapping[str, Sequence[int]]) -> str:
    """The per-tensor group of a layer: its checkpoint tensors in the order
    it holds them. Each must lie in the layer whole: on this rank when vLLM
    takes the layer's amax here alone, over the ranks (this rank's share of
    it at least) when it all-reduces the amax over them."""
    names, count = [], {}
    for p in rt.pieces:
        if p.canonical not in count:
            names.append(p.canonical)
        n = 1
        for e in p.extent:
            n *= e
        count[p.canonical] = count.get(p.canonical, 0) + n
    tp = int(getattr(layer, "tp_size", 1) or 1)
    sharded = tp > 1 and (getattr(layer, "input_size", 0) != getattr(layer, "input_size_per_partition", 0)
                          or getattr(layer, "output_size", 0) != getattr(layer, "output_size_per_partition", 0))
    for name in names:
        shape = checkpoint.get(name)
        if shape is None:
            raise ValueError(f"{rt.name!r} holds {name!r}, whose checkpoint shape is unknown")
        whole = 1
        for d in shape:
            whole *= d
        if count[name] * (tp if sharded else 1) < whole:
            raise ValueError(f"{rt.name!r} holds {count[name]} of the {whole} elements of {name!r}"
                             f"{f' on each of {tp} ranks' if sharded else ''}: per-tensor FP8 scales the layer by "
                             "its amax, and a source quantizing whole checkpoint tensors cannot give the amax of "
                             "part of one. Use quantization='fp8_per_channel'")
    return group_name(names)


def _block_units(rt: RuntimeTensor, checkpoint: Mapping[str, Sequence[int]]) -> List[tuple]:
    """The block scales' pieces of a per-block layer: each piece's blocks,
    when every piece starts on a block boundary in both the checkpoint
    tensor and the layer and ends on one or at the end of both (then the
    layer's blocks are the checkpoint tensor's)."""
    units = []
    for p in rt.pieces:
        shape = checkpoint.get(p.canonical)
        if shape is None:
            raise ValueError(f"{rt.name!r} holds {p.canonical!r}, whose checkpoint shape is unknown")
        for d, what in enumerate(("rows", "columns")):
            start, extent, at = p.start[d], p.extent[d], p.at[d]
            ends = start + extent == shape[d] and at + extent == rt.shape[d]
            if start % BLOCK or at % BLOCK or (extent % BLOCK and not ends):
                raise ValueError(
                    f"{rt.name!r} holds {what} [{start}, {start + extent}) of {p.canonical!r} at [{at}, {at + extent}), "
                    f"off vLLM's {BLOCK}x{BLOCK} FP8 blocks: a block of this layer would span other values than that "
                    f"tensor's block, which quantizing each checkpoint tensor on its own cannot give. Use a "
                    f"tensor-parallel degree that splits this layer on {BLOCK}-element boundaries, or "
                    f"quantization='fp8_per_channel'")
        units.append((p.canonical, tuple(s // BLOCK for s in p.start), tuple(-(-e // BLOCK) for e in p.extent),
                      tuple(a // BLOCK for a in p.at)))
    return list(dict.fromkeys(units))
