"""Runtime layouts of tensor-parallel inference engines, as pieces of the
canonical (Hugging Face checkpoint) tensors.

wsync publishes every version in one canonical name space: the full tensors,
named as in the checkpoint. An inference engine holds something else on each
tensor-parallel rank: row and column slices of them, fused (``qkv_proj`` is
this rank's q, k and v rows stacked; ``gate_up_proj`` its gate and up rows),
key/value heads replicated when the TP degree exceeds their number, and the
vocabulary padded. A :class:`RuntimeTensor` says what one rank holds as
:class:`Piece` s: each a box of a canonical tensor (start and extent per
dimension) placed at an offset of the runtime tensor. Runtime elements that
no piece covers (vocabulary padding) belong to the engine alone.

:func:`tp_layout` builds them from a model's ``config.json`` for the Llama
(with or without ``attention_bias`` and ``mlp_bias``), Qwen2 (q/k/v biases)
and Qwen3 (q/k norms) dense families and the Qwen3-MoE and Mixtral
mixture-of-experts families, tied or untied, laid out as vLLM and SGLang lay
them out (``QKVParallelLinear``, ``MergedColumnParallelLinear``,
``RowParallelLinear``, ``VocabParallelEmbedding`` with padding to a multiple
of 64, ``FusedMoE``'s ``w13_weight`` / ``w2_weight``), for any TP degree the
model allows (1, 2, 4, 8 are tested).

Mixture-of-experts layers: the checkpoint holds one tensor per expert
(``mlp.experts.{e}.gate_proj.weight`` and so on: the Hugging Face Hub's
format, which wsync publishes whatever a trainer holds in memory; see
:func:`canonical_tensors`); the engine holds every local expert stacked in a
fused tensor, expert ``e``'s gate and up rows in ``w13_weight[e]`` and its
down projection in ``w2_weight[e]``. A runtime tensor of one expert is named
``"<parameter>[e]"``: the ``e``-th slice of the engine's parameter (resolve it
with :func:`runtime_tensor`). The experts are split over the MoE group (the
tensor-parallel ranks of every data-parallel replica together, as vLLM
flattens them): by their intermediate dimension, or whole experts per rank
with expert parallelism.

:func:`shard` builds a rank's runtime tensors from canonical ones and
:func:`gather` the canonical tensors back from every rank's (checking that
replicas agree): the reference for tests and for loading a first version.

Only the layout is computed here; no engine is imported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

__all__ = ["Piece", "RuntimeTensor", "canonical_shapes", "canonical_tensors", "tp_layout", "runtime_tensor", "shard",
           "gather", "VOCAB_PADDING"]

VOCAB_PADDING = 64  # vLLM's and SGLang's DEFAULT_VOCAB_PADDING_SIZE

_FAMILIES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
             "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral"}
_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
                "mixtral": "mixtral"}
# Per family: the MoE block's name in a decoder layer, and its experts' gate, up and down tensors.
_MOE_NAMES = {"qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
              "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}


@dataclass(frozen=True)
class Piece:
    """A box of canonical tensor ``canonical`` placed at ``at`` in a runtime tensor."""
    canonical: str
    start: tuple[int, ...]
    extent: tuple[int, ...]
    at: tuple[int, ...]

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(s, s + e) for s, e in zip(self.start, self.extent))

    def target(self) -> tuple[slice, ...]:
        return tuple(slice(a, a + e) for a, e in zip(self.at, self.extent))


@dataclass(frozen=True)
class RuntimeTensor:
    """One tensor of a rank: its engine name, shape, and the pieces it holds."""
    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


def _family(config: Mapping) -> str:
    archs = config.get("architectures") or []
    for a in archs:
        if a in _FAMILIES:
            return _FAMILIES[a]
    model_type = config.get("model_type")
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ValueError(f"unsupported model: architectures {archs or None}, model_type {model_type!r} "
                     f"(supported: {sorted(_FAMILIES)})")


def _dims(config: Mapping) -> dict:
    family = _family(config)
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        d = {
            "family": family,
            "vocab": int(config["vocab_size"]),
            "hidden": hidden,
            "inter": int(config["intermediate_size"]),
            "layers": int(config["num_hidden_layers"]),
            "heads": heads,
            "kv": int(config.get("num_key_value_heads") or heads),
            "head_dim": int(config.get("head_dim") or hidden // heads),
            "tied": bool(config.get("tie_word_embeddings", False)),
        }
    except KeyError as e:
        raise ValueError(f"config.json lacks {e.args[0]!r}") from None
    d["qkv_bias"] = d["family"] == "qwen2" or bool(config.get("attention_bias", False))
    d["o_bias"] = d["family"] == "llama" and bool(config.get("attention_bias", False))
    d["mlp_bias"] = d["family"] == "llama" and bool(config.get("mlp_bias", False))
    d["qk_norm"] = d["family"] in ("qwen3", "qwen3_moe")
    d["sparse"] = set()
    if family in _MOE_NAMES:
        try:
            # Transformers 5 writes Qwen3-MoE's num_experts as num_local_experts, as Mixtral's.
            d["experts"] = int(config["num_experts"] if "num_experts" in config else config["num_local_experts"])
            if family == "mixtral":
                d["moe_inter"] = d["inter"]
                d["sparse"] = set(range(d["layers"]))
            else:
                d["moe_inter"] = int(config["moe_intermediate_size"])
                step, dense = int(config.get("decoder_sparse_step") or 1), set(config.get("mlp_only_layers") or ())
                d["sparse"] = {i for i in range(d["layers"]) if i not in dense and d["experts"] and (i + 1) % step == 0}
        except KeyError as e:
            raise ValueError(f"config.json lacks {e.args[0]!r}") from None
        if config.get("shared_expert_intermediate_size"):
            raise ValueError("shared experts (shared_expert_intermediate_size) are not described by wsync.layouts")
    return d


def canonical_shapes(config: Mapping) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensors and their shapes (what wsync publishes)."""
    d = _dims(config)
    h, hd, q, kv = d["hidden"], d["head_dim"], d["heads"] * d["head_dim"], d["kv"] * d["head_dim"]
    out = {"model.embed_tokens.weight": (d["vocab"], h)}
    for i in range(d["layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (q, h)
        out[p + "self_attn.k_proj.weight"] = (kv, h)
        out[p + "self_attn.v_proj.weight"] = (kv, h)
        if d["qkv_bias"]:
            out[p + "self_attn.q_proj.bias"] = (q,)
            out[p + "self_attn.k_proj.bias"] = (kv,)
            out[p + "self_attn.v_proj.bias"] = (kv,)
        if d["qk_norm"]:
            out[p + "self_attn.q_norm.weight"] = (hd,)
            out[p + "self_attn.k_norm.weight"] = (hd,)
        out[p + "self_attn.o_proj.weight"] = (h, q)
        if d["o_bias"]:
            out[p + "self_attn.o_proj.bias"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        if i in d["sparse"]:
            block, gate, up, down = _MOE_NAMES[d["family"]]
            out[f"{p}{block}.gate.weight"] = (d["experts"], h)
            for e in range(d["experts"]):
                x = f"{p}{block}.experts.{e}."
                out[x + gate + ".weight"] = out[x + up + ".weight"] = (d["moe_inter"], h)
                out[x + down + ".weight"] = (h, d["moe_inter"])
            continue
        out[p + "mlp.gate_proj.weight"] = (d["inter"], h)
        out[p + "mlp.up_proj.weight"] = (d["inter"], h)
        out[p + "mlp.down_proj.weight"] = (h, d["inter"])
        if d["mlp_bias"]:
            out[p + "mlp.gate_proj.bias"] = (d["inter"],)
            out[p + "mlp.up_proj.bias"] = (d["inter"],)
            out[p + "mlp.down_proj.bias"] = (h,)
    out["model.norm.weight"] = (h,)
    if not d["tied"]:
        out["lm_head.weight"] = (d["vocab"], h)
    return out


def _divide(n: int, by: int, what: str, group: str = "the tensor-parallel size") -> int:
    if n % by:
        raise ValueError(f"{what} ({n}) is not divisible by {group} {by}")
    return n // by


def _rows(canonical: str, row0: int, rows: int, at_row: int, width: tuple[int, ...]) -> Piece:
    """Rows [row0, row0 + rows) of a canonical tensor (all of its other dims), at row at_row."""
    return Piece(canonical, (row0,) + (0,) * len(width), (rows,) + width, (at_row,) + (0,) * len(width))


def tp_layout(config: Mapping, tp_size: int, tp_rank: int, *, moe_size: int | None = None,
              moe_rank: int | None = None, expert_parallel: bool = False) -> list[RuntimeTensor]:
    """What rank ``tp_rank`` of ``tp_size`` holds in vLLM or SGLang (their
    layouts of these families are the same), in engine parameter names.

    Mixture-of-experts layers are split over the MoE group, rank ``moe_rank``
    of ``moe_size`` (default: the tensor-parallel group; vLLM's is every
    data-parallel replica's TP ranks, ``dp_rank * tp_size + tp_rank`` of
    ``dp_size * tp_size``): each expert's intermediate dimension, or with
    ``expert_parallel`` whole experts, a contiguous range per rank (vLLM's
    ``linear`` placement).

    Raises ValueError naming the reason when the model cannot be split so
    (heads, experts or an intermediate size not divisible, an unsupported
    model)."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} of {tp_size}")
    moe_size, moe_rank = (tp_size, tp_rank) if moe_size is None else (moe_size, moe_rank or 0)
    if moe_size < 1 or not 0 <= moe_rank < moe_size:
        raise ValueError(f"MoE rank {moe_rank} of {moe_size}")
    d = _dims(config)
    h, hd = d["hidden"], d["head_dim"]
    heads = _divide(d["heads"], tp_size, "num_attention_heads")
    if tp_size >= d["kv"]:
        # Fewer key/value heads than ranks: one per rank, replicated.
        kv_heads, replicas = 1, _divide(tp_size, d["kv"], "the tensor-parallel size over num_key_value_heads")
    else:
        kv_heads, replicas = _divide(d["kv"], tp_size, "num_key_value_heads"), 1
    q_rows, kv_rows = heads * hd, kv_heads * hd
    kv_rank = tp_rank // replicas
    inter = _divide(d["inter"], tp_size, "intermediate_size")
    padded = -(-d["vocab"] // VOCAB_PADDING) * VOCAB_PADDING
    per_rank_vocab = _divide(padded, tp_size, "the padded vocabulary")
    v0 = tp_rank * per_rank_vocab
    v_rows = max(0, min(d["vocab"], v0 + per_rank_vocab) - v0)

    def vocab(name: str, canonical: str) -> RuntimeTensor:
        pieces = (_rows(canonical, v0, v_rows, 0, (h,)),) if v_rows else ()
        return RuntimeTensor(name, (per_rank_vocab, h), pieces)

    def whole(name: str, shape: tuple[int, ...]) -> RuntimeTensor:
        return RuntimeTensor(name, shape, (Piece(name, (0,) * len(shape), shape, (0,) * len(shape)),))

    out = [vocab("model.embed_tokens.weight", "model.embed_tokens.weight")]
    for i in range(d["layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out.append(whole(p + "input_layernorm.weight", (h,)))
        qkv = (_rows(a + "q_proj.weight", tp_rank * q_rows, q_rows, 0, (h,)),
               _rows(a + "k_proj.weight", kv_rank * kv_rows, kv_rows, q_rows, (h,)),
               _rows(a + "v_proj.weight", kv_rank * kv_rows, kv_rows, q_rows + kv_rows, (h,)))
        out.append(RuntimeTensor(a + "qkv_proj.weight", (q_rows + 2 * kv_rows, h), qkv))
        if d["qkv_bias"]:
            bias = (_rows(a + "q_proj.bias", tp_rank * q_rows, q_rows, 0, ()),
                    _rows(a + "k_proj.bias", kv_rank * kv_rows, kv_rows, q_rows, ()),
                    _rows(a + "v_proj.bias", kv_rank * kv_rows, kv_rows, q_rows + kv_rows, ()))
            out.append(RuntimeTensor(a + "qkv_proj.bias", (q_rows + 2 * kv_rows,), bias))
        if d["qk_norm"]:
            out.append(whole(a + "q_norm.weight", (hd,)))
            out.append(whole(a + "k_norm.weight", (hd,)))
        out.append(RuntimeTensor(a + "o_proj.weight", (h, q_rows),
                                 (Piece(a + "o_proj.weight", (0, tp_rank * q_rows), (h, q_rows), (0, 0)),)))
        if d["o_bias"]:  # RowParallelLinear: every rank holds the whole bias (rank 0 adds it)
            out.append(whole(a + "o_proj.bias", (h,)))
        out.append(whole(p + "post_attention_layernorm.weight", (h,)))
        if i in d["sparse"]:
            out.extend(_experts(d, p, moe_size, moe_rank, expert_parallel))
            continue
        m = p + "mlp."
        gate_up = (_rows(m + "gate_proj.weight", tp_rank * inter, inter, 0, (h,)),
                   _rows(m + "up_proj.weight", tp_rank * inter, inter, inter, (h,)))
        out.append(RuntimeTensor(m + "gate_up_proj.weight", (2 * inter, h), gate_up))
        if d["mlp_bias"]:
            out.append(RuntimeTensor(m + "gate_up_proj.bias", (2 * inter,),
                                     (_rows(m + "gate_proj.bias", tp_rank * inter, inter, 0, ()),
                                      _rows(m + "up_proj.bias", tp_rank * inter, inter, inter, ()))))
        out.append(RuntimeTensor(m + "down_proj.weight", (h, inter),
                                 (Piece(m + "down_proj.weight", (0, tp_rank * inter), (h, inter), (0, 0)),)))
        if d["mlp_bias"]:
            out.append(whole(m + "down_proj.bias", (h,)))
    out.append(whole("model.norm.weight", (h,)))
    if not d["tied"]:
        out.append(vocab("lm_head.weight", "lm_head.weight"))
    return out


def _experts(d: dict, p: str, size: int, rank: int, expert_parallel: bool) -> list[RuntimeTensor]:
    """One MoE block of one rank: the router replicated, and per local expert
    its rows of w13_weight (gate, then up) and its columns of w2_weight."""
    block, gate, up, down = _MOE_NAMES[d["family"]]
    h, n = d["hidden"], d["experts"]
    if expert_parallel:
        local, inter = _divide(n, size, "the number of experts", "the expert-parallel size"), d["moe_inter"]
        first, i0 = rank * local, 0
    else:
        local, inter = n, _divide(d["moe_inter"], size, "the experts' intermediate size", "the MoE group's size")
        first, i0 = 0, rank * inter
    b = f"{p}{block}."
    out = [RuntimeTensor(b + "gate.weight", (n, h), (Piece(b + "gate.weight", (0, 0), (n, h), (0, 0)),))]
    for e in range(local):
        x = f"{b}experts.{first + e}."
        out.append(RuntimeTensor(f"{b}experts.w13_weight[{e}]", (2 * inter, h),
                                 (_rows(x + gate + ".weight", i0, inter, 0, (h,)),
                                  _rows(x + up + ".weight", i0, inter, inter, (h,)))))
    for e in range(local):
        x = f"{b}experts.{first + e}."
        out.append(RuntimeTensor(f"{b}experts.w2_weight[{e}]", (h, inter),
                                 (Piece(x + down + ".weight", (0, i0), (h, inter), (0, 0)),)))
    return out


def runtime_tensor(params: Mapping, name: str):
    """The tensor a runtime name stands for: ``params[name]``, or for
    ``"<parameter>[e]"`` the ``e``-th slice of that parameter (one expert of a
    fused MoE tensor; of a view in another dtype, naming the Parameter as
    the view does). Raises KeyError naming a parameter ``params`` lacks."""
    base, _, index = name.partition("[")
    tensor = params[base]
    if not index:
        return tensor
    part = tensor[int(index[:-1])]
    owner = getattr(tensor, "wsync_owner", None)  # a view in another dtype names its Parameter
    if owner is not None:
        part.wsync_owner = owner
    return part


def canonical_tensors(named: Mapping, config: Mapping) -> dict:
    """The canonical (checkpoint) tensors of a trainer's model, as views of
    its own tensors: what wsync publishes. Transformers 5 holds a MoE block's
    experts fused (``mlp.experts.gate_up_proj`` [experts, 2 x intermediate,
    hidden], ``mlp.experts.down_proj``); the checkpoints of the Hub, and
    therefore the canonical name space, hold one tensor per expert. Other
    tensors pass unchanged. Raises ValueError naming a tensor the config does
    not describe or one it describes that is missing or of another shape."""
    d = _dims(config)
    out = {}
    for name, t in named.items():
        parts = name.split(".")
        if len(parts) == 6 and parts[:2] == ["model", "layers"] and parts[3:5] == ["mlp", "experts"] \
                and d["family"] in _MOE_NAMES and parts[5] in ("gate_up_proj", "down_proj"):
            block, gate, up, down = _MOE_NAMES[d["family"]]
            p = f"model.layers.{parts[2]}.{block}.experts."
            for e in range(t.shape[0]):
                if parts[5] == "down_proj":
                    out[f"{p}{e}.{down}.weight"] = t[e]
                else:
                    half = t.shape[1] // 2
                    out[f"{p}{e}.{gate}.weight"], out[f"{p}{e}.{up}.weight"] = t[e, :half], t[e, half:]
        elif len(parts) == 6 and parts[3:5] == ["mlp", "gate"] and d["family"] == "mixtral":
            out[f"model.layers.{parts[2]}.block_sparse_moe.gate.weight"] = t
        else:
            out[name] = t
    want = canonical_shapes(config)
    for name, shape in want.items():
        if name not in out:
            raise ValueError(f"the model lacks {name!r} {shape}, a tensor of its config's checkpoint")
        if tuple(out[name].shape) != tuple(shape):
            raise ValueError(f"{name!r} is {tuple(out[name].shape)}, the config says {tuple(shape)}")
    extra = sorted(set(out) - set(want))
    if extra:
        raise ValueError(f"tensors the config does not describe: {extra[:5]}")
    return out


def shard(canonical: Mapping, layout: Sequence[RuntimeTensor]) -> dict:
    """A rank's runtime tensors (torch) from canonical ones; uncovered
    elements are zero. Raises KeyError naming a missing canonical tensor."""
    import torch
    out = {}
    for rt in layout:
        first = canonical[rt.pieces[0].canonical] if rt.pieces else next(iter(canonical.values()))
        t = torch.zeros(rt.shape, dtype=first.dtype)
        for pc in rt.pieces:
            t[pc.target()] = canonical[pc.canonical][pc.slices()]
        out[rt.name] = t
    return out


def _bits(t):
    import torch
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def gather(ranks: Iterable[tuple[Sequence[RuntimeTensor], Mapping]], shapes: Mapping[str, tuple[int, ...]]) -> dict:
    """The canonical tensors from every rank's (layout, runtime tensors).
    Raises ValueError when an element is covered by no rank, or when two
    ranks holding the same element (replicas) differ in a bit."""
    import torch
    out, seen = {}, {}
    for layout, tensors in ranks:
        for rt in layout:
            src = tensors[rt.name]
            for pc in rt.pieces:
                if pc.canonical not in out:
                    out[pc.canonical] = torch.zeros(shapes[pc.canonical], dtype=src.dtype)
                    seen[pc.canonical] = torch.zeros(shapes[pc.canonical], dtype=torch.bool)
                box, dst, got = src[pc.target()], out[pc.canonical][pc.slices()], seen[pc.canonical][pc.slices()]
                if bool((got & (_bits(dst) != _bits(box))).any()):
                    raise ValueError(f"replicas of {pc.canonical} differ in the box at {pc.start} of {pc.extent}")
                dst.copy_(box)
                got.fill_(True)
    for name, shape in shapes.items():
        if name not in seen or not bool(seen[name].all()):
            raise ValueError(f"no rank holds all of {name} {tuple(shape)}")
    return out
