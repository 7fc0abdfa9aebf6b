"""How many FP8 weights and scales change per RL step, measured with vLLM's own
FP8 weight quantization on consecutive BF16 snapshots (docs/fp8.md).

    <vLLM python> scripts/measure_fp8.py --data ../shared/data/rl-small-lr1e-6 \
        [--data DIR2] [--gap 1] [--per-pair] [--check-engine] [--codec BUILD]

Every directory holds `step_NNNN.safetensors` (BF16, identical tensor names)
and may hold `config.json`. Each snapshot's linear weights are grouped the way
vLLM's Llama-style models fuse them (q/k/v -> qkv_proj, gate/up ->
gate_up_proj; every other 2-D weight except the embeddings and lm_head on its
own; vLLM quantizes neither those nor norms and biases) and quantized in three
modes, each with the function vLLM's online quantization runs in
`process_weights_after_loading` (vllm/model_executor/layers/quantization/online/fp8.py):

  tensor   Fp8PerTensorOnlineLinearMethod (`fp8_per_tensor`, also what
           `quantization="fp8"` does on a BF16 checkpoint): weight_amax ->
           _fp8_scale -> ops.scaled_fp8_quant(weight, scale=...). That op has
           no CPU kernel in vLLM's CPU build (its `_C` registers
           static_scaled_fp8_quant with an empty schema); when it fails the
           script uses vLLM's own pure-torch path for the same static
           per-tensor quantization, QuantFP8(static=True,
           group_shape=PER_TENSOR).forward_native, and says so.
  block    Fp8PerBlockOnlineLinearMethod (`fp8_per_block`, 128x128 blocks,
           `weight_scale_inv`): vllm.utils.deep_gemm.per_block_cast_to_fp8(
           weight, [128, 128], use_ue8m0=False). Pure torch, runs on CPU. The
           same layout as a checkpoint already quantized with
           weight_block_size=[128, 128].
  channel  Fp8PtpcOnlineLinearMethod (`fp8_per_channel`): weight_amax(dim=-1)
           -> _fp8_channel_scale -> _fp8_quant_per_channel. Pure torch.

For every pair (step i, step i+gap) it reports the fraction of BF16 elements
that changed, of FP8 codes that changed, of scales that changed, how often a
per-tensor scale change rescaled a whole tensor, the bytes per version of the
dense FP8 weights, of a sparse FP8 patch (option a: changed codes and scales),
of a sparse BF16 patch (option b: the sink keeps a BF16 shadow and
re-quantizes), the shadow's size and the sink's re-quantization work.
Medians over pairs. Patch sizes are raw estimates (varint gap index + raw
value, no entropy coding, each tensor capped at its dense size), the same rule
for both options.

--codec BUILD also measures both options with wsync's own codec (entropy
coded): each snapshot is written as the FP8 engine's tensors (every quantized
module's codes as F8_E4M3 `<module>.weight` and its scales as F32
`<module>.weight_scale`, the rest BF16; option a) into a temporary directory,
and BUILD's `wsync-bench codec` encodes consecutive pairs of it and of the
BF16 snapshots themselves (option b ships today's BF16 patches). Bytes per
version, medians over pairs.

--check-engine starts vLLM (CPU) on the first snapshot of the first --data
directory for each mode, in a child process each, and compares every
quantized weight and scale the engine holds with the script's, bit for bit;
a mode whose engine does not load prints vLLM's error.
"""
import argparse
import glob
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MODES = ("tensor", "block", "channel")
VLLM_QUANT = {"tensor": "fp8_per_tensor", "block": "fp8_per_block", "channel": "fp8_per_channel"}
BLOCK = (128, 128)
FUSE = [(re.compile(r"^(.*)\.(q|k|v)_proj\.weight$"), "qkv_proj", ("q", "k", "v")),
        (re.compile(r"^(.*)\.(gate|up)_proj\.weight$"), "gate_up_proj", ("gate", "up"))]
NOT_QUANTIZED = re.compile(r"(embed_tokens|lm_head|embed|wte|norm)")


# --------------------------------------------------------------------------- quantizers

class Quantizers:
    """vLLM's own FP8 weight quantization, one function per mode."""

    def __init__(self):
        import torch
        from vllm import _custom_ops as ops
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
        from vllm.model_executor.layers.quantization.online import fp8 as ofp8
        from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape, weight_amax
        from vllm.utils.deep_gemm import per_block_cast_to_fp8
        self.torch, self.ops, self.ofp8, self.weight_amax = torch, ops, ofp8, weight_amax
        self.per_block_cast_to_fp8 = per_block_cast_to_fp8
        with set_current_vllm_config(VllmConfig()):
            self.quant_fp8 = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR, compile_native=False)
        w = torch.ones(2, 16, dtype=torch.bfloat16)
        try:
            ops.scaled_fp8_quant(w, scale=torch.ones(1))
            self.tensor_fn = "ops.scaled_fp8_quant (vLLM's kernel, as Fp8PerTensorOnlineLinearMethod)"
            self.tensor_native = False
        except Exception as e:  # the CPU build: placeholder schema, no kernel
            self.tensor_fn = ("QuantFP8(static, PER_TENSOR).forward_native [FALLBACK: ops.scaled_fp8_quant "
                              f"fails on this CPU: {str(e).splitlines()[0][:110]}]")
            self.tensor_native = True
        self.describe = {
            "tensor": "weight_amax -> _fp8_scale -> " + self.tensor_fn,
            "block": "vllm.utils.deep_gemm.per_block_cast_to_fp8(w, [128, 128], use_ue8m0=False)",
            "channel": "weight_amax(dim=-1) -> _fp8_channel_scale -> _fp8_quant_per_channel",
        }

    def __call__(self, mode, w):
        """w: BF16 (N, K) as vLLM's layer holds it before processing. Returns
        (codes as uint8 (N, K), scales float32 in vLLM's shape)."""
        torch, ofp8 = self.torch, self.ofp8
        if mode == "tensor":
            scale = ofp8._fp8_scale(self.weight_amax(w).reshape(1))
            if self.tensor_native:
                q, _ = self.quant_fp8.forward_native(w, scale)
            else:
                q, _ = self.ops.scaled_fp8_quant(w, scale=scale)
        elif mode == "block":
            q, scale = self.per_block_cast_to_fp8(w, block_size=list(BLOCK), use_ue8m0=False)
        else:
            scale = ofp8._fp8_channel_scale(self.weight_amax(w, dim=-1, keepdim=True))
            q = ofp8._fp8_quant_per_channel(w, scale)
        return q.view(torch.uint8), scale.float()


# --------------------------------------------------------------------------- snapshots

def snapshots(d):
    files = sorted(glob.glob(os.path.join(d, "step_*.safetensors")))
    if len(files) < 2:
        sys.exit(f"{d}: fewer than two step_*.safetensors")
    return files


def split_model(sd):
    """-> (quantized: {vllm module: BF16 (N, K)}, rest: {name: tensor})"""
    import torch
    groups, rest = {}, {}
    for name, t in sd.items():
        for rx, fused, parts in FUSE:
            m = rx.match(name)
            if m and t.dim() == 2:
                groups.setdefault(f"{m.group(1)}.{fused}", {})[m.group(2)] = (parts, t)
                break
        else:
            if t.dim() == 2 and name.endswith(".weight") and not NOT_QUANTIZED.search(name):
                groups[name[: -len(".weight")]] = {"": (("",), t)}
            else:
                rest[name] = t
    quant = {}
    for mod, shards in groups.items():
        order = next(iter(shards.values()))[0]
        if set(shards) != set(order):  # an unfused remainder: quantize each shard alone
            for k, (_, t) in shards.items():
                quant[f"{mod}[{k}]"] = t
        else:
            quant[mod] = torch.cat([shards[k][1] for k in order], 0) if len(order) > 1 else shards[order[0]][1]
    return quant, rest


# --------------------------------------------------------------------------- byte estimates

def varint_gap_bytes(flat_idx):
    """Bytes of LEB128 varints of the gaps between sorted flat positions."""
    import torch
    if flat_idx.numel() == 0:
        return 0
    gaps = torch.diff(flat_idx, prepend=flat_idx.new_full((1,), -1))
    n = torch.ones_like(gaps)
    for b in (7, 14, 21, 28, 35):
        n += (gaps >= (1 << b)).long()
    return int(n.sum())


def sparse_bytes(changed_mask, value_bytes, dense_bytes):
    """min(varint-gap index + raw values, dense) for one tensor."""
    idx = changed_mask.reshape(-1).nonzero().reshape(-1)
    if idx.numel() == 0:
        return 0
    return min(varint_gap_bytes(idx) + idx.numel() * value_bytes, dense_bytes)


# --------------------------------------------------------------------------- measurement

def bits(t):
    """A tensor's raw bits as integers, one per element, flat."""
    import torch
    return t.reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def unit_view(t, mode):
    """(units, elements per unit) view of an (N, K) tensor for a mode's scale
    granularity: the whole tensor, 128x128 blocks (zero-padded at the edges,
    in the order of vLLM's weight_scale_inv), or rows."""
    import torch
    if mode == "tensor":
        return t.reshape(1, -1)
    if mode == "channel":
        return t
    N, K = t.shape
    bn, bk = BLOCK
    pn, pk = -N % bn, -K % bk
    if pn or pk:
        is_bool = t.dtype == torch.bool
        t = torch.nn.functional.pad(t.to(torch.uint8) if is_bool else t, (0, pk, 0, pn))
        t = t.bool() if is_bool else t
    nb_n, nb_k = (N + pn) // bn, (K + pk) // bk
    return t.reshape(nb_n, bn, nb_k, bk).permute(0, 2, 1, 3).reshape(nb_n * nb_k, bn * bk)


def measure_pair(quant_a, quant_b, rest_a, rest_b, cache_a, cache_b):
    import torch
    out = {}
    n_q = sum(t.numel() for t in quant_a.values())
    n_rest = sum(t.numel() for t in rest_a.values())
    bf16_changed = {k: bits(quant_a[k]).view(quant_a[k].shape) != bits(quant_b[k]).view(quant_a[k].shape) for k in quant_a}
    n_bf16_q = sum(int(m.sum()) for m in bf16_changed.values())
    rest_changed = {k: bits(rest_a[k]) != bits(rest_b[k]) for k in rest_a}
    n_bf16_rest = sum(int(m.sum()) for m in rest_changed.values())
    rest_patch = sum(sparse_bytes(m, rest_a[k].element_size(), rest_a[k].numel() * rest_a[k].element_size())
                     for k, m in rest_changed.items())
    b_patch = sum(sparse_bytes(m, 2, m.numel() * 2) for m in bf16_changed.values())
    common = dict(n_q=n_q, n_rest=n_rest, bf16_q=n_bf16_q / n_q,
                  bf16_all=(n_bf16_q + n_bf16_rest) / (n_q + n_rest),
                  rest_dense=sum(t.numel() * t.element_size() for t in rest_a.values()),
                  rest_patch=rest_patch, b_patch=b_patch, shadow=2 * n_q)
    for mode in MODES:
        r = dict(common)
        codes_changed = codes_scale_only = scales = scales_changed = 0
        resc_tensors = resc_elems = resc_codes = 0
        a_patch = dense = work = units_touched = units = rescan = 0
        for k in quant_a:
            ca, sa = cache_a[mode][k]
            cb, sb = cache_b[mode][k]
            cm = ca != cb
            sm = bits(sa) != bits(sb)
            bm = bf16_changed[k]
            n_codes = int(cm.sum())
            codes_changed += n_codes
            codes_scale_only += int((cm & ~bm).sum())
            scales += sa.numel()
            scales_changed += int(sm.sum())
            d = ca.numel() + 4 * sa.numel()
            dense += d
            a_patch += min(sparse_bytes(cm, 1, ca.numel()) + sparse_bytes(sm, 4, 4 * sa.numel()), d)
            if mode == "tensor" and bool(sm.any()):
                resc_tensors += 1
                resc_elems += ca.numel()
                resc_codes += n_codes
            # Option (b)'s sink, per quantization unit (the tensor, a 128x128
            # block, a row): quantization is elementwise once the unit's scale
            # is known, so a unit whose scale is unchanged needs only its changed
            # elements re-quantized; a unit whose scale changed is re-quantized
            # whole; a unit where a changed element held the old amax needs its
            # amax re-scanned from the shadow to know which case it is in.
            chg = unit_view(bm, mode)
            size = unit_view(torch.ones_like(bm), mode).sum(1)
            old_abs = unit_view(quant_a[k].float().abs(), mode)
            at_amax = chg & (old_abs == old_abs.amax(dim=1, keepdim=True))
            scale_chg = sm.reshape(-1)
            touched = chg.any(1)
            units += chg.shape[0]
            units_touched += int(touched.sum())
            rescan += int(at_amax.any(1).sum())
            work += int(size[scale_chg].sum()) + int(chg.sum(1)[~scale_chg].sum())
        r.update(codes=codes_changed / n_q, codes_scale_only=codes_scale_only / n_q,
                 scales=scales_changed / scales, n_scales=scales, n_scales_changed=scales_changed,
                 units_touched=units_touched / units, work=work / n_q, rescan=rescan / units,
                 fp8_dense=dense, a_patch=a_patch)
        if mode == "tensor":
            r.update(resc_tensors=resc_tensors, n_tensors=len(quant_a),
                     resc_codes_n=resc_codes, resc_elems=resc_elems)
        out[mode] = r
    return out


def load(path):
    from safetensors.torch import load_file
    return load_file(path)


def run_dir(Q, d, gap, per_pair):
    files = snapshots(d)
    pairs = [(i, i + gap) for i in range(len(files) - gap)]
    if not pairs:
        sys.exit(f"{d}: no pairs at gap {gap}")
    need = sorted({i for p in pairs for i in p})
    quant, rest, cache = {}, {}, {}
    for i in need:
        quant[i], rest[i] = split_model(load(files[i]))
        cache[i] = {m: {k: Q(m, w) for k, w in quant[i].items()} for m in MODES}
    results = []
    for a, b in pairs:
        r = measure_pair(quant[a], quant[b], rest[a], rest[b], cache[a], cache[b])
        results.append(r)
        if per_pair:
            t, bl, ch = r["tensor"], r["block"], r["channel"]
            print(f"  {os.path.basename(files[a])} -> {os.path.basename(files[b])}: BF16 {100*t['bf16_q']:.3f}% | "
                  f"codes tensor {100*t['codes']:.3f}% block {100*bl['codes']:.3f}% channel {100*ch['codes']:.3f}% | "
                  f"tensor scales changed {t['resc_tensors']}/{t['n_tensors']}")
    return files, pairs, quant[need[0]], rest[need[0]], results


def med(results, mode, key):
    vals = [r[mode][key] for r in results if r[mode].get(key) == r[mode].get(key)]  # drop NaN
    return statistics.median(vals) if vals else float("nan")


def pct(x):
    return "n/a" if x != x else (f"{100*x:.3f}%" if x < 0.1 else f"{100*x:.1f}%")


def kb(x):
    return f"{x/1000:.1f} kB"


def print_table(d, gap, files, pairs, quant, rest, results):
    n_q = sum(t.numel() for t in quant.values())
    n_rest = sum(t.numel() for t in rest.values())
    print(f"\n## {d}: {len(files)} snapshots, {len(pairs)} pairs at gap {gap}; medians over pairs")
    print(f"quantized: {len(quant)} linear modules (vLLM-fused), {n_q/1e6:.3f} M elements; "
          f"left BF16 by vLLM (embeddings, lm_head, norms, biases): {n_rest/1e6:.3f} M elements")
    rows = [
        ("BF16 elements changed (quantized set)", lambda m: pct(med(results, m, "bf16_q"))),
        ("BF16 elements changed (whole model)", lambda m: pct(med(results, m, "bf16_all"))),
        ("FP8 codes changed", lambda m: pct(med(results, m, "codes"))),
        ("  of which the BF16 value did not change", lambda m: pct(med(results, m, "codes_scale_only"))),
        ("scales changed", lambda m: f"{pct(med(results, m, 'scales'))} of {results[0][m]['n_scales']}"),
        ("tensors rescaled (median; all pairs)", lambda m: (
            f"{med(results, m, 'resc_tensors'):g} of {results[0][m]['n_tensors']}; "
            f"{sum(r[m]['resc_tensors'] for r in results)} of {len(results) * results[0][m]['n_tensors']}"
            if m == "tensor" else "-")),
        ("  codes changed inside rescaled tensors", lambda m: pct(
            sum(r[m]["resc_codes_n"] for r in results) / max(1, sum(r[m]["resc_elems"] for r in results))
            if any(r[m]["resc_elems"] for r in results) else float("nan")) if m == "tensor" else "-"),
        ("units (tensor/block/row) with a BF16 change", lambda m: pct(med(results, m, "units_touched"))),
        ("(b) units whose amax must be re-scanned", lambda m: pct(med(results, m, "rescan"))),
        ("(b) elements the sink re-quantizes", lambda m: pct(med(results, m, "work"))),
        ("dense FP8 (codes + fp32 scales)", lambda m: kb(med(results, m, "fp8_dense"))),
        ("(a) FP8 patch: changed codes + scales", lambda m: kb(med(results, m, "a_patch"))),
        ("(b) BF16 patch of the quantized set", lambda m: kb(med(results, m, "b_patch"))),
        ("(b) BF16 shadow held by the sink", lambda m: kb(results[0][m]["shadow"])),
        ("BF16 patch of the unquantized rest (both)", lambda m: kb(med(results, m, "rest_patch"))),
        ("dense BF16 of the unquantized rest", lambda m: kb(results[0][m]["rest_dense"])),
        ("per version, (a): FP8 patch + rest patch", lambda m: kb(med(results, m, "a_patch") + med(results, m, "rest_patch"))),
        ("per version, (b): BF16 patch + rest patch", lambda m: kb(med(results, m, "b_patch") + med(results, m, "rest_patch"))),
        ("per version, dense FP8 engine weights", lambda m: kb(med(results, m, "fp8_dense") + results[0][m]["rest_dense"])),
        ("(a) dense FP8 / patch", lambda m: f"{med(results, m, 'fp8_dense') / max(1, med(results, m, 'a_patch')):.1f}x"),
        ("(b) patch / (a) patch", lambda m: f"{med(results, m, 'b_patch') / max(1, med(results, m, 'a_patch')):.2f}"),
    ]
    w0 = max(len(r[0]) for r in rows)
    cells = [[f(m) for m in MODES] for _, f in rows]
    w = [max(len(MODES[i]), *(len(c[i]) for c in cells)) for i in range(3)]
    print(f"| {'':<{w0}} | " + " | ".join(f"{m:>{w[i]}}" for i, m in enumerate(MODES)) + " |")
    print(f"|{'-'*(w0+2)}|" + "|".join("-" * (w[i] + 2) for i in range(3)) + "|")
    for (name, _), c in zip(rows, cells):
        print(f"| {name:<{w0}} | " + " | ".join(f"{c[i]:>{w[i]}}" for i in range(3)) + " |")


# --------------------------------------------------------------------------- engine check

def engine_child(mode, model_dir, expect_path):
    """Run in a child: load vLLM on the CPU with `quantization=fp8_per_*` and
    compare the engine's FP8 weights and scales with the script's."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm_env import prepare_cpu
    prepare_cpu()
    import torch
    from vllm import LLM
    try:
        llm = LLM(model=model_dir, quantization=VLLM_QUANT[mode], enforce_eager=True, skip_tokenizer_init=True,
                  dtype="bfloat16", max_model_len=128, max_num_seqs=2, max_num_batched_tokens=128,
                  kv_cache_memory_bytes=32 << 20)
    except Exception as e:
        print(f"ENGINE {mode}: load FAILED: {type(e).__name__}: {' '.join(str(e).split())[:600]}")
        return

    def grab(model):
        return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}

    params = llm.apply_model(grab)[0]
    expect = torch.load(expect_path)
    bad = 0
    for mod, (codes, scale) in expect.items():
        w = params.get(f"{mod}.weight")
        s = params.get(f"{mod}.weight_scale_inv" if mode == "block" else f"{mod}.weight_scale")
        if w is None or s is None:
            print(f"ENGINE {mode}: {mod}: not found in the engine"); bad += 1; continue
        w = w.view(torch.uint8)
        if mode != "block":  # online per-tensor / per-channel store qweight.t(): (K, N)
            w = w.t()
        c_ok = torch.equal(w, codes)
        s_ok = torch.equal(s.float().reshape(-1).view(torch.int32), scale.reshape(-1).view(torch.int32))
        if not (c_ok and s_ok):
            bad += 1
            print(f"ENGINE {mode}: {mod}: codes {'equal' if c_ok else f'differ in {int((w != codes).sum())} of {codes.numel()}'}, "
                  f"scales {'equal' if s_ok else 'differ'}")
    print(f"ENGINE {mode}: loaded; {len(expect) - bad} of {len(expect)} modules bit-identical "
          f"(codes and scales) to the script's quantization")


def check_engine(Q, d):
    import torch
    files = snapshots(d)
    cfg = os.path.join(d, "config.json")
    if not os.path.exists(cfg):
        print(f"--check-engine: {d} has no config.json; skipped")
        return
    tmp = tempfile.mkdtemp(prefix="wsync_fp8_")
    os.symlink(cfg, os.path.join(tmp, "config.json"))
    os.symlink(files[0], os.path.join(tmp, "model.safetensors"))
    quant, _ = split_model(load(files[0]))
    print(f"\n## engine check on {files[0]} (vLLM CPU backend)")
    for mode in MODES:
        exp = os.path.join(tmp, f"expect_{mode}.pt")
        torch.save({k: Q(mode, w) for k, w in quant.items()}, exp)
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--_engine-child", mode, tmp, exp],
                           capture_output=True, text=True, timeout=600)
        lines = [l for l in (p.stdout + p.stderr).splitlines() if l.startswith("ENGINE ")]
        print("\n".join(lines) if lines else f"ENGINE {mode}: child exited {p.returncode} without a result:\n"
              + "\n".join((p.stdout + p.stderr).splitlines()[-8:]))


# --------------------------------------------------------------------------- main

# --------------------------------------------------------------------------- wsync's codec

def write_fp8_snapshots(Q, d, mode, out):
    """Each snapshot of `d` as an FP8 engine of `mode` holds it, into `out`
    (mode None: the BF16 rest alone, what both options ship as today)."""
    import torch
    from safetensors.torch import save_file
    for path in snapshots(d):
        quant, rest = split_model(load(path))
        tensors = dict(rest)
        for mod, w in quant.items() if mode else ():
            codes, scale = Q(mode, w)
            tensors[f"{mod}.weight"] = codes.view(torch.float8_e4m3fn).contiguous()
            tensors[f"{mod}.weight_scale"] = scale.contiguous()
        save_file(tensors, os.path.join(out, os.path.basename(path)))


def codec_bytes(build, d, gap):
    """wsync's patch bytes per pair of `d` (BUILD's wsync-bench codec), and the dense bytes."""
    import json
    bench = os.path.join(build, "bench", "wsync-bench")
    p = subprocess.run([bench, "--json", "--repeat", "1", "codec", d, "--gap", str(gap), "--no-baselines"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{bench} codec {d} failed ({p.returncode}): {p.stderr[-2000:]}")
    pairs = json.loads(p.stdout)["pairs"]
    return [q["wsync"]["bytes"] for q in pairs], pairs[0]["dense_bytes"]


def measure_codec(Q, build, d, gap):
    print(f"\n== {d}: wsync's codec, bytes per version (gap {gap}, medians over pairs; whole model: the "
          "quantized set and the rest)")
    def measured(mode):
        with tempfile.TemporaryDirectory(prefix="wsync_fp8_") as out:
            write_fp8_snapshots(Q, d, mode, out)
            return codec_bytes(build, out, gap)

    b, dense_b = codec_bytes(build, d, gap)
    rest, _ = measured(None)
    # The quantized set's share of a version: the whole version less the rest's patch, pair by pair.
    b_q = statistics.median(x - r for x, r in zip(b, rest))
    print(f"  (b) BF16 patches, as today:                  {kb(statistics.median(b)):>10}   (dense BF16 {kb(dense_b)}); "
          f"of which the quantized set {kb(b_q)}, the BF16 rest {kb(statistics.median(rest))}")
    for mode in MODES:
        a, dense_a = measured(mode)
        a_q = statistics.median(x - r for x, r in zip(a, rest))
        print(f"  (a) FP8 codes + scales ({mode:<7}), BF16 rest: {kb(statistics.median(a)):>10}   "
              f"(dense {kb(dense_a)}); of which the quantized set {kb(a_q)}; (b) / (a): whole "
              f"{statistics.median(b) / statistics.median(a):.1f}, quantized set {b_q / a_q:.1f}")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--_engine-child":
        engine_child(*sys.argv[2:5])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", action="append", required=True, help="directory of step_NNNN.safetensors (repeatable)")
    ap.add_argument("--gap", type=int, default=1, help="compare step i with step i+GAP (default 1)")
    ap.add_argument("--per-pair", action="store_true", help="print one line per pair too")
    ap.add_argument("--check-engine", action="store_true",
                    help="also load vLLM (CPU) per mode and compare its FP8 parameters bit for bit")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--codec", metavar="BUILD", help="also measure both options with this build's wsync-bench codec")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch
    torch.set_num_threads(args.threads)
    Q = Quantizers()
    print("reference quantization functions (vLLM %s, platform %s):" % (
        __import__("vllm").__version__, __import__("vllm.platforms", fromlist=["x"]).current_platform.device_name))
    for m in MODES:
        print(f"  {m:<8} {Q.describe[m]}")
    print("patch bytes: varint gap index + raw value (1 B FP8 code, 2 B BF16, 4 B fp32 scale), "
          "each tensor capped at its dense size; no entropy coding")
    for d in args.data:
        files, pairs, quant, rest, results = run_dir(Q, d, args.gap, args.per_pair)
        print_table(d, args.gap, files, pairs, quant, rest, results)
        if args.codec:
            measure_codec(Q, args.codec, d, args.gap)
    if args.check_engine:
        check_engine(Q, args.data[0])


if __name__ == "__main__":
    main()
