#!/usr/bin/python3
"""wsync.layouts against the engines' own loading rules.

For Llama (grouped kv heads), Qwen2 (qkv biases, tied embeddings) and Qwen3
(q/k norms, head_dim apart from hidden/heads) configurations at TP 1, 2, 4
and 8: every rank's runtime tensors built from wsync's pieces equal, bit for
bit, what vLLM's weight loaders put there (QKVParallelLinear with kv-head
replication, MergedColumnParallelLinear, RowParallelLinear,
VocabParallelEmbedding with padding to 64; reimplemented here in the
loaders' own procedural terms); the canonical tensors gathered back from the
ranks equal the originals; a replica that differs and a missing rank are
caught. The Llama-style model of examples/ (Hugging Face names), trained
for a step, has exactly the canonical tensors its config describes.

    layouts_test.py BUILD_DIR
"""
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

CONFIGS = {
    "llama-gqa": {"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 256,
                  "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
                  "num_key_value_heads": 2, "tie_word_embeddings": False},
    "qwen2-tied": {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 1000, "hidden_size": 128,
                   "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
                   "num_key_value_heads": 4, "tie_word_embeddings": True},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 777, "hidden_size": 128, "head_dim": 32,
              "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 8,
              "num_key_value_heads": 2, "tie_word_embeddings": False},
}

MOE_CONFIGS = [
    {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 1000, "hidden_size": 128, "head_dim": 32,
     "intermediate_size": 256, "moe_intermediate_size": 64, "num_experts": 4, "mlp_only_layers": [1],
     "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4, "_experts": 4},
    {"architectures": ["MixtralForCausalLM"], "vocab_size": 1000, "hidden_size": 128, "intermediate_size": 64,
     "num_local_experts": 8, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
     "_experts": 8},
]

failures = []


def check(ok, what):
    print(("  ok: " if ok else "  FAIL: ") + what)
    if not ok:
        failures.append(what)


def random_canonical(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def vllm_load(cfg, tp, rank, w):
    """What vLLM's weight loaders build on rank `rank` of `tp` from the
    checkpoint `w`, written in their terms (shard ids, offsets, narrow)."""
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    inter, vocab = cfg["intermediate_size"], cfg["vocab_size"]
    num_heads = heads // tp
    if tp >= kv:
        num_kv, replicas = 1, tp // kv
    else:
        num_kv, replicas = kv // tp, 1
    out = {}

    def vocab_parallel(name):
        padded = (vocab + 63) // 64 * 64
        per = padded // tp
        start, end = rank * per, min(rank * per + per, vocab)
        p = torch.zeros(per, h, dtype=torch.bfloat16)
        if end > start:
            p[: end - start] = w[name][start:end]
        out[name] = p

    vocab_parallel("model.embed_tokens.weight")
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        a = pre + "self_attn."
        for suffix, width in (("weight", (h,)), ("bias", ())):
            if suffix == "bias" and "Qwen2" not in cfg["architectures"][0]:
                continue
            qkv = torch.zeros(((num_heads + 2 * num_kv) * hd,) + width, dtype=torch.bfloat16)
            for shard_id, offset, size in (("q", 0, num_heads * hd), ("k", num_heads * hd, num_kv * hd),
                                           ("v", (num_heads + num_kv) * hd, num_kv * hd)):
                shard_rank = rank if shard_id == "q" else rank // replicas
                qkv.narrow(0, offset, size).copy_(w[f"{a}{shard_id}_proj.{suffix}"].narrow(0, shard_rank * size, size))
            out[f"{a}qkv_proj.{suffix}"] = qkv
        size = num_heads * hd
        out[a + "o_proj.weight"] = w[a + "o_proj.weight"].narrow(1, rank * size, size).clone()
        if "Qwen3" in cfg["architectures"][0]:
            out[a + "q_norm.weight"] = w[a + "q_norm.weight"].clone()
            out[a + "k_norm.weight"] = w[a + "k_norm.weight"].clone()
        m = pre + "mlp."
        shard = inter // tp
        gate_up = torch.zeros(2 * shard, h, dtype=torch.bfloat16)
        for idx, part in enumerate(("gate_proj", "up_proj")):
            gate_up.narrow(0, idx * shard, shard).copy_(w[f"{m}{part}.weight"].narrow(0, rank * shard, shard))
        out[m + "gate_up_proj.weight"] = gate_up
        out[m + "down_proj.weight"] = w[m + "down_proj.weight"].narrow(1, rank * shard, shard).clone()
        out[pre + "input_layernorm.weight"] = w[pre + "input_layernorm.weight"].clone()
        out[pre + "post_attention_layernorm.weight"] = w[pre + "post_attention_layernorm.weight"].clone()
    out["model.norm.weight"] = w["model.norm.weight"].clone()
    if not cfg.get("tie_word_embeddings"):
        vocab_parallel("lm_head.weight")
    return out


def main():
    build = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build")
    sys.path.insert(0, os.path.join(build, "python"))  # the assembled package
    from wsync import layouts
    for name, cfg in CONFIGS.items():
        shapes = layouts.canonical_shapes(cfg)
        w = random_canonical(shapes, seed=len(name))
        print(f"== {name}: {len(shapes)} canonical tensors")
        for tp in (1, 2, 4, 8):
            ranks = []
            exact = True
            for rank in range(tp):
                layout = layouts.tp_layout(cfg, tp, rank)
                mine = layouts.shard(w, layout)
                theirs = vllm_load(cfg, tp, rank, w)
                exact = exact and sorted(mine) == sorted(theirs) and all(same_bits(mine[k], theirs[k]) for k in theirs)
                ranks.append((layout, mine))
            check(exact, f"TP {tp}: every rank's tensors equal vLLM's loaders' bit for bit")
            back = layouts.gather(ranks, shapes)
            check(sorted(back) == sorted(shapes) and all(same_bits(back[k], w[k]) for k in shapes),
                  f"TP {tp}: the canonical tensors gathered from the ranks are the originals")
        # A replica that differs, and a rank missing, are caught.
        cfg_layouts = [layouts.tp_layout(cfg, 8, r) for r in range(8)]
        tensors = [layouts.shard(w, lay) for lay in cfg_layouts]
        k = "model.layers.0.self_attn.qkv_proj.weight"
        tensors[1][k][-1, 0] = tensors[1][k][-1, 0] + 1  # rank 1's copy of a replicated kv head
        try:
            layouts.gather(zip(cfg_layouts, tensors), shapes)
            check(False, "a differing replica is caught")
        except ValueError as e:
            check("replicas of" in str(e), f"a differing replica is caught: {e}")
        tensors = [layouts.shard(w, lay) for lay in cfg_layouts]
        try:
            layouts.gather(list(zip(cfg_layouts, tensors))[:7], shapes)
            check(False, "a missing rank is caught")
        except ValueError as e:
            check("no rank holds" in str(e), f"a missing rank is caught: {e}")

    print("== explicit: Llama, 8 heads, 2 kv heads, TP 4 (kv heads replicated twice)")
    cfg = CONFIGS["llama-gqa"]
    hd = 32
    for rank in range(4):
        qkv = next(t for t in layouts.tp_layout(cfg, 4, rank) if t.name.endswith("0.self_attn.qkv_proj.weight"))
        starts = [(p.canonical.split(".")[-2], p.start[0], p.extent[0], p.at[0]) for p in qkv.pieces]
        want = [("q_proj", rank * 2 * hd, 2 * hd, 0), ("k_proj", rank // 2 * hd, hd, 2 * hd),
                ("v_proj", rank // 2 * hd, hd, 3 * hd)]
        check(starts == want and qkv.shape == (4 * hd, 256), f"rank {rank}: qkv_proj = q heads {2 * rank}-{2 * rank + 1}, "
                                                             f"kv head {rank // 2}: {starts}")
    emb = [t for t in layouts.tp_layout(CONFIGS["qwen3"], 8, 7) if t.name == "model.embed_tokens.weight"][0]
    check(emb.shape == (104, 128) and emb.pieces[0].start == (728, 0) and emb.pieces[0].extent == (49, 128),
          "vocabulary 777 padded to 832: rank 7 of 8 holds rows 728..776 in its first 49 of 104 rows")

    print("== mixtures of experts: Qwen3-MoE (a dense layer among sparse ones) and Mixtral")
    for cfg in MOE_CONFIGS:
        shapes = layouts.canonical_shapes(cfg)
        w = random_canonical(shapes, seed=7)
        for group, ep in ((1, False), (2, False), (4, False), (2, True), (4, True)):
            ranks = [(layouts.tp_layout(cfg, group, r, expert_parallel=ep), None) for r in range(group)]
            ranks = [(lay, layouts.shard(w, lay)) for lay, _ in ranks]
            back = layouts.gather(ranks, shapes)
            experts = [t for t in ranks[-1][0] if t.name.startswith("model.layers.0.") and "w13_weight[" in t.name]
            check(all(same_bits(back[k], w[k]) for k in shapes) and len(experts) == cfg["_experts"] // (group if ep else 1),
                  f"{cfg['architectures'][0]}, {group} ranks{' expert parallel' if ep else ''}: {len(experts)} "
                  "experts per MoE layer on a rank; sharded and gathered back bit for bit")
        # A trainer's fused experts (transformers 5) are the checkpoint's per-expert tensors, as views.
        fused = {}
        for name, t in w.items():
            fused[name] = t
        block, gate, up, down = ("block_sparse_moe", "w1", "w3", "w2") if "Mixtral" in cfg["architectures"][0] \
            else ("mlp", "gate_proj", "up_proj", "down_proj")
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}.{block}."
            if p + "gate.weight" not in w:
                continue
            n = cfg["_experts"]
            fused[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([w[f"{p}experts.{e}.{gate}.weight"], w[f"{p}experts.{e}.{up}.weight"]]) for e in range(n)])
            fused[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack(
                [w[f"{p}experts.{e}.{down}.weight"] for e in range(n)])
            fused[f"model.layers.{i}.mlp.gate.weight"] = fused.pop(p + "gate.weight")
            for e in range(n):
                for x in (gate, up, down):
                    del fused[f"{p}experts.{e}.{x}.weight"]
        canon = layouts.canonical_tensors(fused, cfg)
        base = fused[next(k for k in fused if k.endswith("gate_up_proj"))]
        check(sorted(canon) == sorted(shapes) and all(same_bits(canon[k], w[k]) for k in shapes)
              and any(t.data_ptr() == base[1].data_ptr() for t in canon.values()),
              f"{cfg['architectures'][0]}: fused experts (transformers 5) are the checkpoint's tensors, as views")
    try:
        layouts.tp_layout(MOE_CONFIGS[0], 8, 0, expert_parallel=True)
        check(False, "8 ranks over 4 experts refused")
    except ValueError as e:
        check("number of experts" in str(e), f"8 ranks over 4 experts refused: {e}")

    print("== what cannot be split says why")
    for bad_tp, expect in ((3, "num_attention_heads"), (16, "num_attention_heads")):
        try:
            layouts.tp_layout(CONFIGS["llama-gqa"], bad_tp, 0)
            check(False, f"TP {bad_tp} refused")
        except ValueError as e:
            check(expect in str(e), f"TP {bad_tp} refused: {e}")
    try:
        layouts.tp_layout({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, 1, 0)
        check(False, "an unsupported model refused")
    except ValueError as e:
        check("unsupported model" in str(e), f"an unsupported model refused: {e}")

    print("== the Llama-style model of examples/, trained for a step")
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from tiny_llama import Config, LlamaForCausalLM
    torch.manual_seed(0)
    c = Config()
    model = LlamaForCausalLM(c)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, c.vocab_size, (2, 16))
    loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).reshape(-1, c.vocab_size), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    cfg = {"architectures": ["LlamaForCausalLM"], **{k: getattr(c, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads")}}
    shapes = layouts.canonical_shapes(cfg)
    state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    check({k: tuple(v.shape) for k, v in state.items()} == shapes,
          f"its {len(state)} tensors are exactly the canonical tensors of its config")
    for tp in (1, 2, 4):
        ranks = [(layouts.tp_layout(cfg, tp, r), None) for r in range(tp)]
        ranks = [(lay, layouts.shard(state, lay)) for lay, _ in ranks]
        back = layouts.gather(ranks, shapes)
        check(all(same_bits(back[k], state[k]) for k in shapes), f"TP {tp}: sharded and gathered back bit for bit")

    print("PASS" if not failures else f"FAIL: {len(failures)} checks")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
