"""Quantized forms of the published tensors, for engines that hold them.

An engine that quantizes the checkpoint after loading (vLLM's online FP8,
per tensor, per channel or per 128x128 block) holds codes and scales, not
the checkpoint's values. Its sinks name what they hold in the layouts they
offer, in the scheme's own name space beside the checkpoint's:

- ``"<scheme>:<name>"``: the E4M3 codes of checkpoint tensor ``<name>``
  (``F8_E4M3``, its shape);
- ``"<scheme>:<name>_scale"``: its scales as the bit patterns of their F32
  values (``I32``: a source publishes F32 tensors as BF16, and scales must
  not be rounded): (N, 1) row scales for ``fp8_per_channel``,
  (ceil(N/128), ceil(K/128)) block scales for ``fp8_per_block``.

Each of those units (a row, a block) is quantized on its own once its scale
is known, so a checkpoint tensor's codes and scales are the same whichever
rank or fused layer holds them, as long as no unit spans two checkpoint
tensors (wsync.vllm.fp8 refuses a layout where one would).

``fp8_per_tensor`` scales a whole fused layer by one amax (vLLM's
``qkv_proj`` stacks q, k and v): the codes of ``<name>`` depend on the
tensors fused with it, its group, written ``<a>+<b>+...`` in the layer's
order. The sink names ``"fp8_per_tensor:<name>@<group>"`` (the codes) and
``"fp8_per_tensor:<group>_scale"`` (the group's one scale, (1,)).

A source asked for them (wsync.Source.register with layouts that name them)
quantizes the tensors with the engine's own functions (vLLM's, imported
where the trainer runs) on the BF16 values it publishes, registers the
codes and scales beside the model's tensors, and quantizes again before
every publish. docs/fp8.md has the measurements behind shipping codes
rather than BF16 values, and what is refused.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Mapping, Sequence, Tuple

import torch

from .layouts import RuntimeTensor

__all__ = ["BLOCK", "PER_BLOCK", "PER_CHANNEL", "PER_TENSOR", "QuantizedTensors", "codes_name", "group_name",
           "members", "owned", "requested", "scale_name", "scale_shape"]

PER_TENSOR = "fp8_per_tensor"
PER_CHANNEL = "fp8_per_channel"
PER_BLOCK = "fp8_per_block"
BLOCK = 128  # the side of vLLM's weight blocks (Fp8PerBlockOnlineLinearMethod.weight_block_size)
_SCHEMES = (PER_TENSOR, PER_CHANNEL, PER_BLOCK)
_IN_GROUP = "@"  # "<name>@<group>": per-tensor codes of a tensor quantized with its group's scale
_JOINED = "+"  # "<a>+<b>": a group's tensors


def group_name(names: Sequence[str]) -> str:
    """The name of a per-tensor group: its tensors in the fused layer's order."""
    return _JOINED.join(names)


def members(group: str) -> List[str]:
    return group.split(_JOINED)


def codes_name(scheme: str, name: str, group: str = "") -> str:
    """The published name of `name`'s codes in `scheme` (per tensor: as a
    member of `group`)."""
    return f"{scheme}:{name}{_IN_GROUP}{group}" if scheme == PER_TENSOR else f"{scheme}:{name}"


def scale_name(scheme: str, name: str) -> str:
    """The published name of the scales of `name` (per tensor: of the
    group `name`) in `scheme`."""
    return f"{scheme}:{name}_scale"


def scale_shape(scheme: str, shape: Sequence[int]) -> Tuple[int, ...]:
    """The shape of the scales of an (N, K) tensor's codes in `scheme`."""
    n, k = shape
    if scheme == PER_BLOCK:
        return -(-n // BLOCK), -(-k // BLOCK)
    if scheme == PER_TENSOR:
        return (1,)
    return n, 1


def requested(layouts: Iterable[Sequence[RuntimeTensor]]) -> Dict[str, str]:
    """The checkpoint tensors `layouts` hold quantized: name -> scheme.
    Raises ValueError naming a quantized name of a scheme this wsync does
    not know (a newer engine's)."""
    held = {}
    for layout in layouts:
        for rt in layout:
            for p in rt.pieces:
                scheme, sep, name = p.canonical.partition(":")
                if not sep:
                    continue
                if scheme not in _SCHEMES:
                    raise ValueError(f"a sink holds {p.canonical!r}, of a quantization this trainer's wsync does not "
                                     f"know ({scheme!r}; it knows {', '.join(_SCHEMES)}): upgrade the trainer's wsync")
                held[name] = scheme
    # Each quantized tensor is held as its codes and its scales ("<name>_scale"; per tensor,
    # "<group>_scale" beside the members' "<name>@<group>").
    return {n: s for n, s in held.items()
            if (_IN_GROUP in n) == (s == PER_TENSOR) and not (n.endswith("_scale") and n[:-len("_scale")] in held)}


def owned(wanted: Mapping[str, str], weights: Mapping[str, torch.Tensor]) -> Dict[str, str]:
    """Those of `wanted` (requested's) that a source part holding `weights`
    quantizes: the tensors it holds, per-tensor groups whole. Raises
    ValueError naming a per-tensor group split between parts (its scale is
    the amax of all of it)."""
    out = {}
    for key, scheme in wanted.items():
        name, _, group = key.partition(_IN_GROUP)
        tensors = members(group) if scheme == PER_TENSOR else [name]
        held = [t in weights for t in tensors]
        if all(held):
            out[key] = scheme
        elif any(held):
            raise ValueError(f"an engine quantizes {', '.join(tensors)} with one FP8 scale ({scheme}), and this "
                             "source part holds only some of them: register them in one part")
    return out


class QuantizedTensors:
    """The quantized forms of the tensors `names` (name -> scheme) of
    `weights` (the tensors a source publishes: F32 masters or BF16),
    computed from their BF16 values by the engine's own quantization, as
    each engine computes them after loading. ``tensors`` are what to
    register; :meth:`refresh` quantizes the weights again, in place. Raises
    ValueError naming a tensor the weights lack or hold other than as a
    matrix."""

    def __init__(self, weights: Mapping[str, torch.Tensor], names: Mapping[str, str]):
        self.tensors: Dict[str, torch.Tensor] = {}
        self._names: List[Tuple[str, str, str, str]] = []  # (tensor, scheme, codes, scales)
        self._groups: Dict[str, List[Tuple[str, str]]] = {}  # per tensor: group -> its (tensor, codes)
        for key, scheme in sorted(names.items()):
            name, _, group = key.partition(_IN_GROUP)
            w = weights.get(name)
            if w is None or w.ndim != 2:
                raise ValueError(f"an engine holds {name!r} quantized ({scheme}), which the trainer's model holds "
                                 f"{'not at all' if w is None else 'as ' + str(tuple(w.shape))}, not as a matrix")
            c, s = codes_name(scheme, name, group), scale_name(scheme, group or name)
            self.tensors[c] = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
            if s not in self.tensors:
                self.tensors[s] = torch.empty(scale_shape(scheme, w.shape), dtype=torch.int32, device=w.device)
            if scheme == PER_TENSOR:
                self._groups.setdefault(group, []).append((name, c))
            else:
                self._names.append((name, scheme, c, s))
        used = {n for n, _, _, _ in self._names} | {t for g in self._groups for t in members(g) if t in weights}
        self._weights = {name: _follower(weights[name]) for name in used}
        for group in self._groups:
            missing = [t for t in members(group) if t not in weights]
            if missing:
                raise ValueError(f"an engine quantizes {group.replace(_JOINED, ', ')} with one FP8 scale "
                                 f"({PER_TENSOR}), and the trainer's model has no {', '.join(missing)}")
        self._quantize = {scheme: _VLLM[scheme]() for scheme in set(names.values())}
        self.refresh()

    def refresh(self) -> None:
        """Quantizes the weights as they are now into the tensors (looked up
        again: registering moves them into shared memory)."""
        with torch.no_grad():
            for name, scheme, c, s in self._names:
                codes, scale = self._quantize[scheme](self._weights[name]().to(torch.bfloat16))
                self.tensors[c].copy_(codes)
                self.tensors[s].view(torch.float32).copy_(scale)
            for group, held in self._groups.items():
                # The group's scale is the amax of all its tensors, whichever of them this engine holds.
                scale, quantize = self._quantize[PER_TENSOR]([self._weights[t]().to(torch.bfloat16)
                                                              for t in members(group)])
                for name, c in held:
                    self.tensors[c].copy_(quantize(self._weights[name]().to(torch.bfloat16)))
                self.tensors[scale_name(PER_TENSOR, group)].view(torch.float32).copy_(scale)


def _follower(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    """`t` as it is when called: a view of a Parameter (one expert of a fused
    MoE parameter) is taken again from the Parameter, which registering
    rebinds to shared memory (the view would still read the old storage)."""
    base = t._base
    if not isinstance(base, torch.nn.Parameter):
        return lambda: t
    shape, stride, offset = tuple(t.shape), tuple(t.stride()), t.storage_offset() - base.storage_offset()
    return lambda: base.data.as_strided(shape, stride, base.data.storage_offset() + offset)


def _vllm_per_channel() -> Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]:
    """vLLM's per-channel weight quantization, as Fp8PtpcOnlineLinearMethod
    runs it after loading (the row amax, the scale, the codes): the
    reference, never a re-implementation."""
    try:
        from vllm.model_executor.layers.quantization.online import fp8 as online
        from vllm.model_executor.layers.quantization.utils.quant_utils import weight_amax
        channel_scale, quant = online._fp8_channel_scale, online._fp8_quant_per_channel
    except (ImportError, AttributeError) as e:
        raise ValueError("an engine holds FP8 weights quantized per channel, and the trainer's Python has no vLLM "
                         "with that quantization (vLLM 0.32's _fp8_channel_scale and _fp8_quant_per_channel) to "
                         f"compute them exactly as the engine does: {e}") from e

    def quantize(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        scale = channel_scale(weight_amax(weight, dim=-1, keepdim=True))
        return _e4m3(quant(weight, scale)), scale
    return quantize


def _vllm_per_block() -> Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]:
    """vLLM's 128x128 block quantization, as Fp8PerBlockOnlineLinearMethod
    runs it after loading (per_block_cast_to_fp8 without UE8M0 scales): the
    reference, never a re-implementation. The scales it returns are the
    dequantization scales vLLM keeps as ``weight_scale_inv``."""
    try:
        from vllm.utils.deep_gemm import per_block_cast_to_fp8
    except (ImportError, AttributeError) as e:
        raise ValueError("an engine holds FP8 weights quantized per 128x128 block, and the trainer's Python has no "
                         "vLLM with that quantization (vLLM 0.32's per_block_cast_to_fp8) to compute them exactly as "
                         f"the engine does: {e}") from e

    def quantize(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        codes, scale = per_block_cast_to_fp8(weight, block_size=[BLOCK, BLOCK], use_ue8m0=False)
        return _e4m3(codes), scale
    return quantize


def _e4m3(codes: torch.Tensor) -> torch.Tensor:
    if codes.dtype != torch.float8_e4m3fn:
        raise ValueError(f"vLLM quantizes to {codes.dtype} on the trainer's platform; the engine's codes are "
                         "E4M3 (float8_e4m3fn)")
    return codes


def _vllm_per_tensor():
    """vLLM's per-tensor quantization, as Fp8PerTensorOnlineLinearMethod runs
    it after loading: the amax of the fused layer (weight_amax, vLLM's
    all-reduced max over the ranks; a max of maxima is exact), its scale
    (_fp8_scale) and the codes (ops.scaled_fp8_quant, elementwise given the
    scale). Returns a function of the group's weights giving the scale and
    a function that quantizes one of them."""
    try:
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers.quantization.online import fp8 as online
        from vllm.model_executor.layers.quantization.utils.quant_utils import weight_amax
        fp8_scale = online._fp8_scale
    except (ImportError, AttributeError) as e:
        raise ValueError("an engine holds FP8 weights quantized per tensor, and the trainer's Python has no vLLM "
                         "with that quantization (vLLM 0.32's _fp8_scale and scaled_fp8_quant) to compute them "
                         f"exactly as the engine does: {e}") from e

    def group(weights: Sequence[torch.Tensor]):
        amax = torch.stack([weight_amax(w).reshape(()) for w in weights]).amax().reshape(1)
        scale = fp8_scale(amax)
        return scale, lambda w: _e4m3(ops.scaled_fp8_quant(w, scale=scale)[0])
    return group


_VLLM = {PER_TENSOR: _vllm_per_tensor, PER_CHANNEL: _vllm_per_channel, PER_BLOCK: _vllm_per_block}
