"""wsync.vllm.loader.derive_layout over small models whose load_weights
writes the way engines' loaders do (narrowed copies into fused, sharded and
stacked parameters, padding fills), and the ways it must refuse (a computed
tensor copied in, a transposed copy, an indexed write, a replaced tensor, a
loader that cannot run on the meta device): the layout is exact, or the
refusal names the parameter and why; the parameters are restored whatever
happens. vLLM's real loaders: vllm_test.py. Needs torch 2.x (the vLLM
environment's Python).

    loader_test.py BUILD
"""
import os
import sys
import weakref

sys.path.insert(0, os.path.join(sys.argv[1], "python"))

import torch  # noqa: E402

from wsync.layouts import Piece  # noqa: E402
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

    print(f"{len(failures)} failed checks" if failures else "PASS")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
