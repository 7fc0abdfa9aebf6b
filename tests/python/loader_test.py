"""wsync.vllm.loader.derive_layout over small models whose load_weights
writes the way engines' loaders do (narrowed copies into fused, sharded and
stacked parameters, padding fills), and the ways it must refuse (a computed
tensor copied in, a transposed copy, an indexed write, a replaced tensor, a
loader that cannot run on the meta device): the layout is exact, or the
refusal names the parameter and why; the parameters are restored whatever
happens. Also what FP8 engines add: the layout of their codes and row
scales, the tensors a trainer is asked for, the refusal of quantizations
wsync does not keep, and codes held transposed moving into shared memory
as they are laid out. vLLM's real loaders and a real FP8 engine:
vllm_test.py. Needs torch 2.x (the vLLM environment's Python).

    loader_test.py BUILD
"""
import os
import sys
import weakref

sys.path.insert(0, os.path.join(sys.argv[1], "python"))

import torch  # noqa: E402

from wsync._tensors import share  # noqa: E402
from wsync.layouts import Piece, RuntimeTensor, runtime_tensor  # noqa: E402
from wsync import quantized  # noqa: E402
from wsync.quantized import requested  # noqa: E402
from wsync.vllm import fp8  # noqa: E402
from wsync.vllm.loader import derive_layout  # noqa: E402

failures = []


def check(cond, what):
    print(("  ok: " if cond else "  FAIL: ") + what, flush=True)
    if not cond:
        failures.append(what)


class Engine(torch.nn.Module):
    """A rank (1 of 2) of a tiny engine: q/k fused and split by rows, o
    split by columns, two stacked experts, a padded vocabulary, a layer
    with a derived weight (process_weights_after_loading), a constant."""

    def __init__(self, mode="ok"):
        super().__init__()
        self.mode = mode
        self.qk = torch.nn.Parameter(torch.randn(6, 8), requires_grad=False)       # q rows 4..7 of 8, k rows 2..3 of 4
        self.o = torch.nn.Parameter(torch.randn(8, 4), requires_grad=False)        # columns 4..7 of 8
        self.w13 = torch.nn.Parameter(torch.randn(2, 4, 8), requires_grad=False)   # experts: gate and up, 2 rows each
        self.embed = torch.nn.Parameter(torch.randn(16, 8), requires_grad=False)   # vocabulary 10..19 of 20, padded
        self.attn = Derives()
        self.rope = torch.nn.Parameter(torch.ones(4), requires_grad=False)        # never loaded: a constant

    def load_weights(self, weights):
        for name, w in weights:
            if name == "q":
                self.qk.data[0:4].copy_(w.narrow(0, 4, 4))
            elif name == "k":
                if self.mode == "transposed":
                    self.qk.data[4:6].copy_(w.narrow(0, 2, 2).t().t().contiguous() * 1)
                else:
                    self.qk.data[4:6].copy_(w.narrow(0, 2, 2))
            elif name == "o":
                if self.mode == "indexed":
                    self.o.data[torch.tensor([0, 1])] = w.narrow(1, 4, 4)[:2]
                else:
                    self.o.data.copy_(w.narrow(1, 4, 4))
            elif name.startswith("experts."):
                e, part = int(name.split(".")[1]), name.split(".")[2]
                self.w13.data[e][(0 if part == "gate" else 2):][:2].copy_(w.narrow(0, 0, 2))
            elif name == "embed":
                if self.mode == "replaced":
                    self.embed.data = w.narrow(0, 10, 10).clone()
                    continue
                self.embed.data[:10].copy_(w.narrow(0, 10, 10))
                self.embed.data[10:].fill_(0)
            elif name == "kv_b":
                if self.mode == "item":
                    w.sum().item()
                self.attn.kv_b.data.copy_(w)


class Derives(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.kv_b = torch.nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.W_UV = torch.nn.Parameter(torch.randn(4, 4), requires_grad=False)

    def process_weights_after_loading(self, act_dtype):
        self.W_UV.data.copy_(self.kv_b.t())


CHECKPOINT = {"q": ((8, 8), torch.float32), "k": ((4, 8), torch.float32), "o": ((8, 8), torch.float32),
              "experts.0.gate": ((2, 8), torch.float32), "experts.0.up": ((2, 8), torch.float32),
              "experts.1.gate": ((2, 8), torch.float32), "experts.1.up": ((2, 8), torch.float32),
              "embed": ((20, 8), torch.float32), "kv_b": ((4, 4), torch.float32), "lm_head": ((20, 8), torch.float32)}


def refused(what, call, *needles):
    """Checks that call() raises ValueError saying every one of `needles`."""
    try:
        call()
        check(False, f"{what}: refused")
    except ValueError as e:
        check(all(n in str(e) for n in needles), f"{what}: refused ({str(e)[:160]})")


def kernel(owner="FP8ScaledMMLinearKernel"):
    """An FP8 kernel whose weight processing is defined by class `owner`
    (named as vLLM names it), as a quantization method holds it."""
    base = type(owner, (), {"process_weights_after_loading": lambda self, layer: None})
    return type("SomeKernel", (base,), {})()


def quant_method(name, owner="FP8ScaledMMLinearKernel"):
    method = type(name, (), {})()
    method.fp8_linear = kernel(owner)
    return method


class Fp8Linear(torch.nn.Module):
    """A linear layer as vLLM's online per-channel FP8 leaves it: E4M3
    codes seen transposed ((K, N) over an (N, K) buffer), (N, 1) F32 row
    scales, and its quantization method (named as vLLM names it)."""

    def __init__(self, n, k, method="Fp8PtpcOnlineLinearMethod"):
        super().__init__()
        codes = torch.randn(n, k).to(torch.float8_e4m3fn)
        self.weight = torch.nn.Parameter(codes.t(), requires_grad=False)
        self.weight_scale = torch.nn.Parameter(torch.rand(n, 1), requires_grad=False)
        self.quant_method = quant_method(method)


class Fp8BlockLinear(torch.nn.Module):
    """A linear layer as vLLM's online per-block FP8 leaves it: (N, K) E4M3
    codes and one F32 scale per 128x128 block, (ceil(N/128), ceil(K/128))."""

    def __init__(self, n, k):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, k).to(torch.float8_e4m3fn), requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(torch.rand(-(-n // 128), -(-k // 128)), requires_grad=False)
        self.quant_method = quant_method("Fp8PerBlockOnlineLinearMethod", "Fp8BlockScaledMMLinearKernel")


def check_fp8():
    print("== FP8 engines: codes and row scales laid out as the loader places the BF16 weight")
    m = torch.nn.Module()
    m.qkv = Fp8Linear(6, 8)
    m.o = Fp8Linear(8, 4)
    m.norm = torch.nn.Linear(2, 2)
    m.gate = torch.nn.Linear(2, 2)
    m.gate.quant_method = type("_GateLinearMethod", (type("UnquantizedLinearMethod", (), {}),), {})()
    layers = fp8.quantized_layers(m)
    check(layers == {"qkv": fp8.PER_CHANNEL, "o": fp8.PER_CHANNEL}, f"the quantized layers: {layers}")
    bf16 = [RuntimeTensor("qkv.weight", (6, 8), (Piece("q", (4, 0), (4, 8), (0, 0)), Piece("k", (2, 0), (2, 8), (4, 0)))),
            RuntimeTensor("o.weight", (8, 4), (Piece("o", (0, 4), (8, 4), (0, 0)),)),
            RuntimeTensor("norm.weight", (2, 2), (Piece("norm", (0, 0), (2, 2), (0, 0)),))]
    tensors, written = fp8.quantized_layout(m, bf16, layers)
    got = {rt.name: rt.pieces for rt in tensors}
    want = {
        "qkv.weight": (Piece("fp8_per_channel:q", (4, 0), (4, 8), (0, 0)), Piece("fp8_per_channel:k", (2, 0), (2, 8), (4, 0))),
        "qkv.weight_scale": (Piece("fp8_per_channel:q_scale", (4, 0), (4, 1), (0, 0)),
                             Piece("fp8_per_channel:k_scale", (2, 0), (2, 1), (4, 0))),
        "o.weight": (Piece("fp8_per_channel:o", (0, 4), (8, 4), (0, 0)),),
        "o.weight_scale": (Piece("fp8_per_channel:o_scale", (0, 0), (8, 1), (0, 0)),),  # a row-parallel layer: whole rows
        "norm.weight": (Piece("norm", (0, 0), (2, 2), (0, 0)),),
    }
    check(got == want, f"codes where the weight's pieces are, scales in their rows, the rest as it was: {got}")
    check(requested([tensors]) == {"q": "fp8_per_channel", "k": "fp8_per_channel", "o": "fp8_per_channel"},
          f"a trainer is asked for the codes and scales of q, k and o: {requested([tensors])}")
    try:
        requested([[RuntimeTensor("x", (2, 2), (Piece("nvfp4:x", (0, 0), (2, 2), (0, 0)),))]])
        check(False, "a scheme the trainer does not know: refused")
    except ValueError as e:
        check("'nvfp4'" in str(e), f"a scheme the trainer does not know: {str(e)[:120]}")

    side = [RuntimeTensor("qkv.weight", (6, 8), (Piece("a", (0, 0), (6, 4), (0, 0)), Piece("b", (0, 0), (6, 4), (0, 4))))]
    refused("rows of two checkpoint tensors side by side (one scale over both)",
            lambda: fp8.quantized_layout(m, side, {"qkv": fp8.PER_CHANNEL}), "'a' and 'b'")

    print("== one expert's scales, a slice of a view in another dtype, name the Parameter they move with")
    experts = torch.nn.Parameter(torch.rand(4, 2, 2), requires_grad=False)
    bits = experts.view(torch.int32)
    bits.wsync_owner = experts
    one = runtime_tensor({"w13_weight_scale_inv": bits}, "w13_weight_scale_inv[2]")
    check(getattr(one, "wsync_owner", None) is experts and one.data_ptr() == experts[2].data_ptr(),
          "expert 2's scale bits name the experts' Parameter")

    print("== codes held transposed move into shared memory as they are laid out")
    codes, scales = m.qkv.weight, m.qkv.weight_scale
    values, bits = codes.t().contiguous().view(torch.uint8).clone(), scales.view(torch.int32).clone()
    reg = share({n: written[n] for n in ("qkv.weight", "qkv.weight_scale")}, "sink")
    try:
        moved = m.qkv.weight is codes and m.qkv.weight_scale is scales
        check(moved and codes.stride() == (1, 8) and torch.equal(codes.t().contiguous().view(torch.uint8), values)
              and torch.equal(scales.view(torch.int32), bits),
              f"the Parameters stay the same objects, strides {codes.stride()} and values")
        shm = reg.memory[0]
        specs = {t.name: t for t in reg.request.tensors}
        raw = torch.frombuffer(shm.mmap, dtype=torch.uint8)
        c, sc = specs["qkv.weight"], specs["qkv.weight_scale"]
        check(c.dtype == "F8_E4M3" and list(c.shape) == [6, 8] and sc.dtype == "I32" and list(sc.shape) == [6, 1],
              f"registered as the (N, K) codes and the scales' bits: {c.dtype} {list(c.shape)}, {sc.dtype} {list(sc.shape)}")
        check(torch.equal(raw[c.offset:c.offset + 48], values.reshape(-1))
              and torch.equal(raw[sc.offset:sc.offset + 24], bits.reshape(-1).view(torch.uint8)),
              "what the sink writes at each registered offset is what the engine reads")
        raw[c.offset] = 0x7E  # the sink writes code (0, 0) as 448
        check(float(codes[0, 0]) == 448.0, f"a write at the codes' offset reaches the engine's parameter: {float(codes[0, 0])}")
    finally:
        reg.unlink()

    print("== quantizations wsync does not keep are refused, naming the layer")
    m.experts = Fp8Linear(4, 4, "Fp8PerChannelOnlineMoEMethod")
    m.stored = Fp8Linear(4, 4, "Fp8LinearMethod")  # an FP8 checkpoint per tensor (no 128x128 blocks)
    try:
        fp8.quantized_layers(m)
        check(False, "MoE experts and an FP8 checkpoint's layers: refused")
    except ValueError as e:
        check("2 layer(s)" in str(e) and "experts (Fp8PerChannelOnlineMoEMethod)" in str(e)
              and "stored (Fp8LinearMethod, an FP8 checkpoint with blocks None" in str(e),
              f"MoE experts and an FP8 checkpoint's layers: {str(e)[:200]}")


def check_fp8_tensors():
    print("== per-tensor FP8: a fused layer's tensors quantized as one group, its one scale")
    m = torch.nn.Module()
    m.qkv = Fp8Linear(6, 8, "Fp8PerTensorOnlineLinearMethod")
    m.qkv.weight_scale = torch.nn.Parameter(torch.rand(1), requires_grad=False)
    m.qkv.tp_size, m.qkv.output_size, m.qkv.output_size_per_partition = 2, 12, 6  # column parallel over 2 ranks
    layers = fp8.quantized_layers(m)
    check(layers == {"qkv": fp8.PER_TENSOR}, f"the quantized layers: {layers}")
    bf16 = [RuntimeTensor("qkv.weight", (6, 8), (Piece("q", (4, 0), (4, 8), (0, 0)), Piece("k", (2, 0), (2, 8), (4, 0))))]
    tensors, written = fp8.quantized_layout(m, bf16, layers, {"q": (8, 8), "k": (4, 8)})
    got = {rt.name: (rt.shape, rt.pieces) for rt in tensors}
    want = {"qkv.weight": ((6, 8), (Piece("fp8_per_tensor:q@q+k", (4, 0), (4, 8), (0, 0)),
                                    Piece("fp8_per_tensor:k@q+k", (2, 0), (2, 8), (4, 0)))),
            "qkv.weight_scale": ((1,), (Piece("fp8_per_tensor:q+k_scale", (0,), (1,), (0,)),))}
    check(got == want, f"codes named with their group, the group's one scale: {got}")
    wanted = requested([tensors])
    check(wanted == {"q@q+k": "fp8_per_tensor", "k@q+k": "fp8_per_tensor"}, f"a trainer is asked for: {wanted}")
    weights = {"q": torch.randn(8, 8), "k": torch.randn(4, 8), "v": torch.randn(4, 8)}
    check(quantized.owned(wanted, weights) == wanted and quantized.owned(wanted, {"o": weights["q"]}) == {},
          "a source part quantizes the groups it holds whole")
    refused("a group split between source parts", lambda: quantized.owned(wanted, {"q": weights["q"]}),
            "q, k", "one part")

    # A replicated layer (vLLM takes its amax on each rank alone) holding half of q: refused.
    m.rep = Fp8Linear(4, 8, "Fp8PerTensorOnlineLinearMethod")
    m.rep.weight_scale = torch.nn.Parameter(torch.rand(1), requires_grad=False)
    refused("a per-tensor layer holding part of a tensor",
            lambda: fp8.quantized_layout(m, [RuntimeTensor("rep.weight", (4, 8), (Piece("q", (0, 0), (4, 8), (0, 0)),))],
                                         {"rep": fp8.PER_TENSOR}, {"q": (8, 8)}),
            "32 of the 64 elements of 'q'")


def check_fp8_blocks():
    print("== per-block FP8: codes where the weight's pieces are, each piece's blocks in the block scales")
    m = torch.nn.Module()
    m.qkv = Fp8BlockLinear(384, 256)  # q 256 rows, k 128 (a rank's share)
    m.o = Fp8BlockLinear(200, 128)  # a row-parallel rank: columns [128, 256) of an o of 200 x 256
    layers = fp8.quantized_layers(m)
    check(layers == {"qkv": fp8.PER_BLOCK, "o": fp8.PER_BLOCK}, f"the quantized layers: {layers}")
    shapes = {"q": (512, 256), "k": (256, 256), "o": (200, 256)}
    bf16 = [RuntimeTensor("qkv.weight", (384, 256), (Piece("q", (256, 0), (256, 256), (0, 0)),
                                                      Piece("k", (128, 0), (128, 256), (256, 0)))),
            RuntimeTensor("o.weight", (200, 128), (Piece("o", (0, 128), (200, 128), (0, 0)),))]
    tensors, written = fp8.quantized_layout(m, bf16, layers, shapes)
    got = {rt.name: (rt.shape, rt.pieces) for rt in tensors}
    want = {
        "qkv.weight": ((384, 256), (Piece("fp8_per_block:q", (256, 0), (256, 256), (0, 0)),
                                    Piece("fp8_per_block:k", (128, 0), (128, 256), (256, 0)))),
        "qkv.weight_scale_inv": ((3, 2), (Piece("fp8_per_block:q_scale", (2, 0), (2, 2), (0, 0)),
                                          Piece("fp8_per_block:k_scale", (1, 0), (1, 2), (2, 0)))),
        "o.weight": ((200, 128), (Piece("fp8_per_block:o", (0, 128), (200, 128), (0, 0)),)),
        # the last row block is ragged (rows 128..199) in the checkpoint and in the layer alike
        "o.weight_scale_inv": ((2, 1), (Piece("fp8_per_block:o_scale", (0, 1), (2, 1), (0, 0)),)),
    }
    check(got == want, f"codes as placed, scales by block: {got}")
    check(written["qkv.weight"] is m.qkv.weight and written["qkv.weight_scale_inv"].dtype == torch.int32
          and written["qkv.weight_scale_inv"].data_ptr() == m.qkv.weight_scale_inv.data_ptr(),
          "the sink writes the (N, K) codes as they are and the scales' bits in place")
    check(requested([tensors]) == {"q": "fp8_per_block", "k": "fp8_per_block", "o": "fp8_per_block"},
          f"a trainer is asked for q, k and o per block: {requested([tensors])}")
    check(quantized.scale_shape(fp8.PER_BLOCK, (200, 256)) == (2, 2), "a trainer's block scales of a 200 x 256 tensor")

    # A rank whose k holds 64 rows (a KV head split over more ranks than 128-row blocks allow): its block
    # would hold k's rows and v's, which quantizing each checkpoint tensor on its own cannot give.
    m.kv = Fp8BlockLinear(128, 256)
    split = [RuntimeTensor("kv.weight", (128, 256), (Piece("k", (64, 0), (64, 256), (0, 0)),
                                                     Piece("v", (64, 0), (64, 256), (64, 0))))]
    refused("a block spanning two checkpoint tensors, naming the rows and what to use",
            lambda: fp8.quantized_layout(m, split, {"kv": fp8.PER_BLOCK}, {"k": (128, 256), "v": (128, 256)}),
            "rows [64, 128) of 'k'", "fp8_per_channel")
    # A ragged end that is not the layer's: the checkpoint's last block would straddle into the next piece.
    m.gu = Fp8BlockLinear(328, 128)
    ragged = [RuntimeTensor("gu.weight", (328, 128), (Piece("g", (0, 0), (200, 128), (0, 0)),
                                                      Piece("u", (0, 0), (128, 128), (200, 0))))]
    refused("a ragged block inside a fused layer",
            lambda: fp8.quantized_layout(m, ragged, {"gu": fp8.PER_BLOCK}, {"g": (200, 128), "u": (128, 128)}),
            "rows [0, 200) of 'g'")
    # A kernel that keeps its scales in another layout (column-major, as some GPU kernels want them).
    m.t = Fp8BlockLinear(256, 256)
    m.t.weight_scale_inv = torch.nn.Parameter(torch.rand(2, 2).t(), requires_grad=False)
    whole = lambda name: [RuntimeTensor(f"{name}.weight", (256, 256), (Piece("t", (0, 0), (256, 256), (0, 0)),))]  # noqa: E731
    refused("block scales in another layout",
            lambda: fp8.quantized_layout(m, whole("t"), {"t": fp8.PER_BLOCK}, {"t": (256, 256)}),
            "'t.weight_scale_inv'")
    # A kernel that rewrites the codes and scales in place after vLLM quantized them (DeepGEMM's UE8M0
    # requantization keeps their shapes): refused, naming it and what to do.
    m.dg = Fp8BlockLinear(256, 256)
    m.dg.quant_method.fp8_linear = kernel("DeepGemmFp8BlockScaledMMKernel")
    refused("a kernel that processes the weights after quantizing them",
            lambda: fp8.quantized_layout(m, whole("dg"), {"dg": fp8.PER_BLOCK}, {"t": (256, 256)}),
            "'dg'", "DeepGemmFp8BlockScaledMMKernel.process_weights_after_loading", "VLLM_USE_DEEP_GEMM=0")


def main():
    print("== what each parameter holds, as the loader places it")
    m = Engine()
    before = {n: (p, p.data_ptr(), p.clone()) for n, p in m.named_parameters()}
    layout = derive_layout(m, CHECKPOINT)
    got = {rt.name: (rt.shape, rt.pieces) for rt in layout.tensors}
    want = {
        "qk": ((6, 8), (Piece("q", (4, 0), (4, 8), (0, 0)), Piece("k", (2, 0), (2, 8), (4, 0)))),
        "o": ((8, 4), (Piece("o", (0, 4), (8, 4), (0, 0)),)),
        "w13[0]": ((4, 8), (Piece("experts.0.gate", (0, 0), (2, 8), (0, 0)), Piece("experts.0.up", (0, 0), (2, 8), (2, 0)))),
        "w13[1]": ((4, 8), (Piece("experts.1.gate", (0, 0), (2, 8), (0, 0)), Piece("experts.1.up", (0, 0), (2, 8), (2, 0)))),
        "embed": ((16, 8), (Piece("embed", (10, 0), (10, 8), (0, 0)),)),
        "attn.kv_b": ((4, 4), (Piece("kv_b", (0, 0), (4, 4), (0, 0)),)),
    }
    check(got == want, f"fused, row and column shards, stacked experts, padding: {got}")
    check([(d.name, d.params) for d in layout.derived] == [("attn", ["attn.W_UV"])],
          f"a layer's parameter its process_weights_after_loading computes is derived: {layout.derived}")
    check(layout.constants == ["rope"], f"a parameter nothing loads is a constant: {layout.constants}")
    check(all(p is q and p.data_ptr() == ptr and torch.equal(p, v) and p.device.type == "cpu"
              for (p, ptr, v), (n, q) in zip(before.values(), m.named_parameters())),
          "the parameters are the same objects, memory and values after it")

    print("== parameters torch.compile holds weak references to (they cannot be swapped in place)")
    m = Engine()
    refs = [weakref.ref(p) for p in m.parameters()]
    before = {n: (p, p.data_ptr(), p.clone()) for n, p in m.named_parameters()}
    again = derive_layout(m, CHECKPOINT)
    check({rt.name: (rt.shape, rt.pieces) for rt in again.tensors} == got,
          "the same layout as for parameters without weak references")
    check([(d.name, d.params) for d in again.derived] == [("attn", ["attn.W_UV"])] and again.constants == ["rope"],
          "the same derived parameters and constants")
    check(all(p is q and p.data_ptr() == ptr and torch.equal(p, v) and p.device.type == "cpu"
              for (p, ptr, v), (n, q) in zip(before.values(), m.named_parameters())) and all(r() is not None for r in refs),
          "the parameters are the same objects, memory and values after it")
    m = Engine("replaced")
    refs = [weakref.ref(p) for p in m.parameters()]
    try:
        derive_layout(m, CHECKPOINT)
        check(False, "replaced, with weak references: refused")
    except ValueError as e:
        check("replaced" in str(e) and "embed:" in str(e), f"replaced, with weak references: {str(e)[:160]}")

    print("== loaders wsync cannot describe are refused, naming the parameter")
    for mode, name, why in (("transposed", "qk", "computed tensor"), ("indexed", "o", "index_put"),
                            ("replaced", "embed", "replaced"), ("item", None, "cannot run over")):
        m = Engine(mode)
        before = {n: p.clone() for n, p in m.named_parameters()}
        try:
            derive_layout(m, CHECKPOINT)
            check(False, f"{mode}: refused")
        except ValueError as e:
            text = str(e)
            check(why in text and (name is None or f"{name}:" in text), f"{mode}: {text[:220]}")
        check(all(p.device.type == "cpu" and torch.equal(p, before[n]) for n, p in m.named_parameters()),
              f"{mode}: the parameters are restored")

    check_fp8()
    check_fp8_blocks()
    check_fp8_tensors()
    print(f"{len(failures)} failed checks" if failures else "PASS")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
