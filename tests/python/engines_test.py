#!/usr/bin/python3
"""wsync.sglang and wsync.rank_sync without an engine: the SGLang custom loader reads the rank,
the TP degree, the model's config and its parameters through SGLang's
parallel state (a stand-in module here: SGLang does not run on this CPU) and
hands them to RankSync; RankSync refuses a model its layout does not
describe before registering anything. The vLLM integration runs against a
real vLLM: vllm_test.py. RankSync against real sinks: client_test.py
tensor_parallel.

    engines_test.py BUILD
"""
import os
import sys
import types

BUILD = os.path.abspath(sys.argv[1])
sys.path.insert(0, os.path.join(BUILD, "python"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))

import torch  # noqa: E402

import wsync.rank_sync as rank_sync  # noqa: E402
import wsync.sglang as sglang_loader  # noqa: E402
from wsync import layouts  # noqa: E402

failures = []


def check(cond, what):
    print(("  ok: " if cond else "  FAIL: ") + what, flush=True)
    if not cond:
        failures.append(what)


CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 128, "intermediate_size": 256,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


class Engine(torch.nn.Module):
    """An engine's model: parameters named and shaped as vLLM's for one rank."""

    def __init__(self, tp, rank):
        super().__init__()
        for rt in layouts.tp_layout(CONFIG, tp, rank):
            self.register_parameter(rt.name.replace(".", "__"), torch.nn.Parameter(torch.zeros(rt.shape)))

    def named_parameters(self, *a, **k):
        return [(n.replace("__", "."), p) for n, p in super().named_parameters(*a, **k)]


class Recorder:
    """Stands in for RankSync: what the adapters hand it."""
    made = []

    def __init__(self, params, layout, address, timeout=60.0, what=""):
        self.args = dict(params=params, layout=layout, address=address, what=what)
        self.synced = []
        self.version = 0
        Recorder.made.append(self)

    def sync(self, version=None, timeout=60.0):
        self.synced.append(version)
        return version or 0


def parallel_state(tp, rank):
    m = types.ModuleType("parallel_state")
    m.get_tensor_model_parallel_rank = lambda: rank
    m.get_tensor_model_parallel_world_size = lambda: tp
    return m


def install(root, state):
    """sys.modules['sglang.srt.distributed.parallel_state'] (and parents) = state."""
    names = {"sglang": ["sglang", "sglang.srt", "sglang.srt.distributed"]}[root]
    for n in names:
        sys.modules[n] = types.ModuleType(n)
    parent = sys.modules[names[-1]]
    parent.parallel_state = state
    sys.modules[names[-1] + ".parallel_state"] = state


def main():
    sglang_loader.RankSync, real = Recorder, sglang_loader.RankSync
    try:
        print("== SGLang custom loader")
        install("sglang", parallel_state(2, 1))
        os.environ["WSYNC_SINK_ADDRESS"] = "unix:/tmp/y/sink-{rank}.sock"
        model = Engine(2, 1)
        model.config = types.SimpleNamespace(to_dict=lambda: dict(CONFIG))
        sglang_loader.load(model, sglang_loader.request(3))
        first = Recorder.made[-1]
        check(first.args["layout"] == layouts.tp_layout(CONFIG, 2, 1) and first.args["what"] == "rank 1 of 2" and
              first.args["address"] == "unix:/tmp/y/sink-1.sock", "SGLang: rank, degree and address")
        sglang_loader.load(model, sglang_loader.request())
        check(Recorder.made[-1] is first and first.synced == [3, None],
              "registered once; synced to 3, then to the newest")
        try:
            sglang_loader.load(model, [("model.norm.weight", torch.zeros(1))])
            check(False, "weights are not a wsync request")
        except ValueError as e:
            check("wsync.sglang.request" in str(e), f"other named tensors are refused: {e}")
    finally:
        sglang_loader.RankSync = real

    print("== RankSync refuses what its layout does not describe, before registering")
    params = dict(Engine(2, 0).named_parameters())
    layout = layouts.tp_layout(CONFIG, 2, 0)
    for what, p in [("a missing parameter", {k: v for k, v in params.items() if "o_proj" not in k}),
                    ("another shape", {**params, "model.norm.weight": torch.zeros(5)})]:
        try:
            rank_sync.RankSync(p, layout, "unix:/nonexistent/sink.sock")
            check(False, what)
        except ValueError as e:
            check(True, f"{what}: {e}")

    print("PASS" if not failures else f"FAIL: {len(failures)} checks")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
