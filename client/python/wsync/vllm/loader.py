"""The layout of a vLLM rank, read from vLLM's own loader.

:func:`derive_layout` answers, for whatever model vLLM loaded, which box of
which checkpoint tensor each parameter of this rank holds, and where: it
runs the model's own ``load_weights`` (its ``stacked_params_mapping``, expert
mappings, every parameter's ``weight_loader``, tensor and expert parallel
splits, vocabulary padding, tied and skipped weights) over the checkpoint's
tensors with every parameter swapped, for the duration, for a tensor of the
same shape on the meta device. Nothing is read, allocated or written; what
the loader does is recorded at the level of torch's operators:

- a copy from a checkpoint tensor, or a view of one (``narrow``, slices,
  ``view``), into a parameter, or a view of one, is a box of that tensor
  placed in that parameter (a :class:`wsync.layouts.Piece`); into one expert
  of a stacked parameter, a piece of ``"<parameter>[e]"``;
- a fill (the padding of a vocabulary) writes no checkpoint value;
- anything else that writes a parameter (a copy of a computed tensor, an
  indexed write, a parameter replaced) is refused, naming the parameter: its
  values would not be the checkpoint's, so a sink writing them would not
  keep the engine exact.

Parameters the loader never writes hold nothing of the checkpoint. Those of
a layer that computes them after loading (``process_weights_after_loading``:
MLA's absorbed ``W_UK_T`` / ``W_UV`` from ``kv_b_proj``) are *derived*: that
layer is re-run after every version (:class:`Derived`). The others are the
engine's own constants and are never written.

The cost is that of the loader's Python over the checkpoint's tensor list:
no memory beyond the tensors' descriptions (docs/vllm.md has figures).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..layouts import Piece, RuntimeTensor

__all__ = ["Derived", "LoaderLayout", "checkpoint_shapes", "derive_layout"]

_SAFETENSORS_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E5M2": getattr(torch, "float8_e5m2", None),
}


@dataclass
class Derived:
    """A layer whose parameters ``params`` are computed from loaded ones
    after loading: re-run through vLLM's own ``process_weights_after_loading``
    after every version."""
    name: str
    module: torch.nn.Module
    params: List[str]

    def recompute(self, act_dtype: torch.dtype) -> None:
        with torch.no_grad():
            self.module.process_weights_after_loading(act_dtype)


@dataclass
class LoaderLayout:
    """What a rank holds: its runtime tensors (parameter names, or
    ``"<parameter>[e]"`` for one expert of a stacked parameter), the layers
    whose parameters are derived, and the parameters that hold nothing of
    the checkpoint (the engine's constants)."""
    tensors: List[RuntimeTensor]
    derived: List[Derived] = field(default_factory=list)
    constants: List[str] = field(default_factory=list)


def checkpoint_shapes(vllm_config) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """The checkpoint vLLM loaded, as vLLM's own loader finds its files:
    each tensor's shape and dtype (read from the safetensors headers; no
    tensor is read). Raises ValueError for a checkpoint not in safetensors."""
    from safetensors import safe_open
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    mc = vllm_config.model_config
    loader = DefaultModelLoader(vllm_config.load_config)
    try:
        prepared = loader._prepare_weights(model_name_or_path=mc.model, subfolder=None, revision=mc.revision,
                                           fall_back_to_pt=False, allow_patterns_overrides=None)
    except TypeError:  # vLLM before the subfolder argument
        prepared = loader._prepare_weights(mc.model, mc.revision, fall_back_to_pt=False,
                                           allow_patterns_overrides=None)
    files, use_safetensors = prepared[1], prepared[2]
    if not use_safetensors:
        raise ValueError(f"the checkpoint {mc.model!r} is not in safetensors: wsync reads the tensors' shapes from "
                         "their headers")
    out = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                s = f.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(s.get_dtype())
                if dtype is None:
                    raise ValueError(f"checkpoint tensor {name!r} in {os.path.basename(path)}: dtype {s.get_dtype()}")
                out[name] = (tuple(s.get_shape()), dtype)
    return out


def _contiguous_strides(shape: Sequence[int]) -> List[int]:
    out, s = [], 1
    for n in reversed(shape):
        out.append(s)
        s *= n
    return out[::-1]


def _box(t: torch.Tensor, shape: Sequence[int]) -> Optional[Tuple[List[int], List[int], List[int]]]:
    """The view `t` of a contiguous tensor of `shape` (its storage) as a box:
    (start, extent) per dimension of `shape`, and the dimension each of the
    view's dimensions runs along (-1 for a dimension of size 1). None when
    the view is not a box (a transpose, a step, a broadcast)."""
    strides = _contiguous_strides(shape)
    offset = t.storage_offset()
    start = []
    for s in strides:
        start.append(offset // s)
        offset %= s
    extent, along, last = [1] * len(shape), [], -1
    for n, s in zip(t.shape, t.stride()):
        if n == 1:
            along.append(-1)
            continue
        d = next((d for d in range(last + 1, len(shape)) if strides[d] == s and shape[d] > 1), None)
        if d is None or start[d] + n > shape[d]:
            return None
        extent[d], last = n, d
        along.append(d)
    return start, extent, along


class _Recorder(TorchDispatchMode):
    """Records the loader's writes into the parameters (meta tensors)."""

    def __init__(self, params: Mapping[int, Tuple[str, Tuple[int, ...]]],
                 sources: Mapping[int, Tuple[str, Tuple[int, ...]]]):
        super().__init__()
        self.params, self.sources = params, sources
        self.copies: List[Tuple[str, Tuple, str, Tuple]] = []
        self.refused: Dict[str, str] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            dst = args[i] if i < len(args) else kwargs.get(a.name)
            if not isinstance(dst, torch.Tensor):
                continue
            param = self.params.get(dst.untyped_storage()._cdata)
            if param is None:
                continue
            name, shape = param
            if func is torch.ops.aten.copy_.default:
                src = args[1]
                source = self.sources.get(src.untyped_storage()._cdata) if isinstance(src, torch.Tensor) else None
                if source is None:
                    self.refused.setdefault(name, "the loader copies a computed tensor into it, not a checkpoint "
                                                  "tensor's values")
                elif tuple(src.shape) != tuple(dst.shape):
                    self.refused.setdefault(name, f"the loader broadcasts {source[0]!r} into it")
                else:
                    self.copies.append((name, (dst, shape), source[0], (src, source[1])))
            elif func not in (torch.ops.aten.fill_.Scalar, torch.ops.aten.fill_.Tensor, torch.ops.aten.zero_.default):
                self.refused.setdefault(name, f"the loader writes it with {func}")
        return func(*args, **kwargs)


def _meta_twin(p: torch.Tensor) -> torch.Tensor:
    """A parameter of `p`'s class, shape and attributes on the meta device."""
    twin = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False)
    twin.__class__ = type(p)
    twin.__dict__.update(p.__dict__)
    return twin


def _piece(copy) -> Tuple[Optional[str], Optional[Tuple[int, ...]], Optional[Piece], str]:
    """(runtime tensor name, its shape, the piece) of one recorded copy, or
    a reason it is none."""
    name, (dst, pshape), canonical, (src, cshape) = copy
    s, d = _box(src, cshape), _box(dst, pshape)
    if s is None or d is None:
        return None, None, None, f"the loader copies {canonical!r} into it through a view that is not a box"
    (c_start, c_extent, c_along), (p_start, p_extent, p_along) = s, d
    lead = len(pshape) - len(cshape)
    if lead not in (0, 1) or (lead == 1 and p_extent[0] != 1):
        return None, None, None, f"it holds {canonical!r} ({len(cshape)} dimensions) in {len(pshape)} dimensions"
    if any(a >= 0 and b >= 0 and b - lead != a for a, b in zip(c_along, p_along)) \
            or p_extent[lead:] != c_extent:
        return None, None, None, f"the loader copies {canonical!r} into it transposed or reshaped"
    piece = Piece(canonical, tuple(c_start), tuple(c_extent), tuple(p_start[lead:]))
    if lead:
        return f"{name}[{p_start[0]}]", tuple(pshape[1:]), piece, ""
    return name, tuple(pshape), piece, ""


def _overlapping(pieces: Sequence[Piece]) -> bool:
    for i, a in enumerate(pieces):
        for b in pieces[i + 1:]:
            if all(x < y + m and y < x + n for x, n, y, m in zip(a.at, a.extent, b.at, b.extent)):
                return True
    return False


def derive_layout(model: torch.nn.Module, checkpoint: Mapping[str, Tuple[Tuple[int, ...], torch.dtype]],
                  weights: Optional[Iterable[str]] = None,
                  formats: Optional[Mapping[str, torch.Tensor]] = None) -> LoaderLayout:
    """The layout of this rank: `model` (a vLLM model, loaded) over the
    `checkpoint`'s tensors (name -> (shape, dtype); checkpoint_shapes), as
    ``model.load_weights`` places them. The parameters are swapped for meta
    tensors while it runs and restored after, whatever happens. `formats`:
    parameters the loader writes in another form than the engine holds them
    now (a quantized layer's weight before quantization), by name: meta
    tensors with their weight loaders, which take those parameters' places
    while the loader runs (their runtime tensors are in that form).

    Raises ValueError naming every parameter whose values the loader does
    not copy from the checkpoint as boxes (computed, transposed or indexed
    writes), or a layer with derived parameters vLLM cannot recompute."""
    names = list(weights) if weights is not None else list(checkpoint)
    unique: Dict[int, Tuple[str, torch.Tensor]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        unique.setdefault(id(p), (n, p))
    # Where each parameter is held: a parameter torch.compile has taken a
    # weak reference to cannot be swapped in place, so the meta twin takes
    # its place in the modules instead.
    holders: Dict[int, List[Tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((module, attr))
    swapped: List[Tuple[torch.Tensor, torch.Tensor]] = []  # swapped in place: (parameter, twin)
    replaced: List[Tuple[torch.nn.Module, str, torch.Tensor]] = []  # in the modules: (module, attr, parameter)
    meta: Dict[int, torch.Tensor] = {}  # parameter id -> the meta tensor the model holds while the loader runs
    try:
        params = {}
        for n, p in unique.values():
            twin = _meta_twin(p)
            try:
                torch.utils.swap_tensors(p, twin)
                swapped.append((p, twin))
                meta[id(p)] = p
            except RuntimeError:
                for module, attr in holders.get(id(p), []):
                    module._parameters[attr] = twin
                    replaced.append((module, attr, p))
                meta[id(p)] = twin
            params[meta[id(p)].untyped_storage()._cdata] = (n, tuple(p.shape))
        modules = dict(model.named_modules())
        for n, twin in (formats or {}).items():
            owner, _, attr = n.rpartition(".")
            module = modules[owner]
            replaced.append((module, attr, module._parameters[attr]))
            module._parameters[attr] = twin
            params[twin.untyped_storage()._cdata] = (n, tuple(twin.shape))
        sources = [(n, torch.empty(checkpoint[n][0], dtype=checkpoint[n][1], device="meta")) for n in names]
        recorder = _Recorder(params, {t.untyped_storage()._cdata: (n, tuple(t.shape)) for n, t in sources})
        try:
            with torch.no_grad(), recorder:
                model.load_weights(iter(sources))
        except Exception as e:  # noqa: BLE001 - any loader's failure: named, with its cause
            raise ValueError(f"vLLM's loader ({type(model).__name__}.load_weights) cannot run over the checkpoint's "
                             f"tensor descriptions, so wsync cannot tell what each parameter holds: "
                             f"{type(e).__name__}: {e}") from e
        for pid, t in meta.items():
            if t.untyped_storage()._cdata not in params:
                recorder.refused.setdefault(unique[pid][0], "the loader replaced the parameter's tensor")
    finally:
        for p, twin in reversed(swapped):
            torch.utils.swap_tensors(p, twin)
        for module, attr, p in reversed(replaced):
            module._parameters[attr] = p

    refused = dict(recorder.refused)
    pieces: Dict[str, List[Piece]] = {}
    shapes: Dict[str, Tuple[int, ...]] = {}
    whole_or_indexed: Dict[str, set] = {}
    for copy in recorder.copies:
        rt, shape, piece, why = _piece(copy)
        if piece is None:
            refused.setdefault(copy[0], why)
            continue
        pieces.setdefault(rt, []).append(piece)
        shapes[rt] = shape
        whole_or_indexed.setdefault(copy[0], set()).add(rt != copy[0])
    for param, kinds in whole_or_indexed.items():
        if len(kinds) > 1:
            refused.setdefault(param, "the loader writes it both whole and by its first index")
    for rt, ps in pieces.items():
        if _overlapping(ps):
            refused.setdefault(rt.partition("[")[0], "the loader writes parts of it twice")
    if refused:
        lines = [f"{n}: {why}" for n, why in sorted(refused.items())]
        raise ValueError(f"vLLM's loader does not place checkpoint values in {len(lines)} parameter(s) as wsync can "
                         "keep them (copies of boxes of checkpoint tensors): " + "; ".join(lines[:8]))

    loaded = {rt.partition("[")[0] for rt in pieces}
    derived: Dict[str, Derived] = {}
    constants = []
    for n, _ in unique.values():
        if n in loaded:
            continue
        owner = n.rpartition(".")[0]
        module = modules.get(owner)
        if module is not None and callable(getattr(module, "process_weights_after_loading", None)) \
                and _takes_dtype(module.process_weights_after_loading):
            derived.setdefault(owner, Derived(owner, module, [])).params.append(n)
        else:
            constants.append(n)
    tensors = [RuntimeTensor(rt, shapes[rt], tuple(sorted(ps, key=lambda p: p.at))) for rt, ps in pieces.items()]
    return LoaderLayout(tensors, list(derived.values()), constants)


def _takes_dtype(method) -> bool:
    """Whether a layer's process_weights_after_loading is the attention
    layers' form (act_dtype), which re-runs in place on the loaded weights."""
    import inspect
    try:
        params = list(inspect.signature(method).parameters)
    except (TypeError, ValueError):
        return False
    return len(params) == 1
