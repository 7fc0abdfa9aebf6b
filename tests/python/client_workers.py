#!/usr/bin/python3
"""Processes for client_test.py, each using the `wsync` Python client as a
real trainer or inference server would.

    client_workers.py trainer LOCAL DIR --steps N --lr LR [--no-pack] [--lockstep K] [--wait S]
    client_workers.py inference LOCAL DIR NAME --until N [--seed S] [--no-pack] [--hold-forever]
    client_workers.py mismatched LOCAL
    client_workers.py tp_inference LOCAL DIR NAME --tp T --rank R --until N

The trainer with --serve-tp 2,4 also serves the sinks of tensor-parallel
ranks (wsync.layouts.tp_layout of every rank of each degree). A tp_inference
process is one such rank: its runtime tensors (fused qkv, gate_up, shards,
padded vocabulary) laid out as vLLM lays them, registered with their layout;
for every version it saves what it holds as DIR/NAME.vN.pt (the test
gathers the canonical tensors back from every rank). With --resize-at V
--resize-tp 2,4 the trainer registers again after version V, serving those
degrees (a resized rollout fleet), says "resized", waits for DIR/go and then
keeps --resize-lockstep K. With --pause-after V it says "paused" once
version V is published (and, with --lockstep, held by every sink) and
waits for DIR/resume.

The trainer trains a Llama-style model for real (AdamW on FP32 masters),
publishes every step and saves the BF16 weights it expects (its own
tensor.to(torch.bfloat16)) as DIR/expect-vN.pt. With --lockstep K it waits
after each publish until K inference processes wrote DIR/NAME.vN (they
verified version N). An inference process builds its own model (own seed),
registers it in place, and for every version: waits, holds, compares every
tensor with the trainer's bit for bit, runs a batch, and writes DIR/NAME.vN.
"""
import argparse
import glob
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
import wsync  # noqa: E402
from wsync import layouts  # noqa: E402
from wsync.rank_sync import RankSync  # noqa: E402
from tiny_llama import Config, LlamaForCausalLM  # noqa: E402


def tiny_config():
    """config.json of examples/tiny_llama's default model."""
    c = Config()
    return {"architectures": ["LlamaForCausalLM"], **{k: getattr(c, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads")}}


def say(**kw):
    print(json.dumps(kw), flush=True)


def bits(t):
    return t.detach().contiguous().view(torch.int16) if t.dtype == torch.bfloat16 else t.detach().contiguous()


def train_step(model, opt, dir, version):
    """One AdamW step on random tokens; saves the BF16 weights that `version`
    must hold as DIR/expect-vN.pt. Returns the loss."""
    ids = torch.randint(0, model.config.vocab_size, (4, 24))
    loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
    expect = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    torch.save(expect, os.path.join(dir, f"expect-v{version}.pt"))
    return loss


def trainer(a):
    torch.manual_seed(1234)
    model = LlamaForCausalLM()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    src = wsync.Source(a.local)
    serve = [layouts.tp_layout(tiny_config(), int(tp), r) for tp in a.serve_tp.split(",") if tp
             for r in range(int(tp))]
    info = src.register(model, pack=not a.no_pack, serve=serve, serve_offered=a.serve_offered)
    params_before = [id(p) for p in model.parameters()]
    say(event="registered", tensors=len(info.tensors), cast=len(info.cast_to_bf16), next=info.next_version)
    for step in range(a.steps):
        version = src.next_version
        loss = train_step(model, opt, a.dir, version)
        t0 = time.monotonic()
        stats = src.publish(wait=a.wait)
        say(event="published", version=stats.version, bytes=stats.patch_bytes, ratio=stats.ratio,
            wait_s=time.monotonic() - t0, loss=loss.item())
        while a.lockstep and len(glob.glob(os.path.join(a.dir, f"*.v{version}"))) < a.lockstep:
            time.sleep(0.01)
        if version == a.pause_after:
            say(event="paused", version=version)
            while not os.path.exists(os.path.join(a.dir, "resume")):
                time.sleep(0.05)
            a.lockstep = a.lockstep_after_pause or a.lockstep
        if version == a.resize_at:
            # The rollout fleet is resized: serve other layouts from the next version on.
            serve = [layouts.tp_layout(tiny_config(), int(tp), r) for tp in a.resize_tp.split(",") for r in range(int(tp))]
            src.register(model, pack=not a.no_pack, serve=serve)
            say(event="resized", version=version)
            while not os.path.exists(os.path.join(a.dir, "go")):
                time.sleep(0.05)
            a.lockstep = a.resize_lockstep
    # The optimizer kept updating the registered (rebound) parameters in place.
    assert params_before == [id(p) for p in model.parameters()]
    say(event="done")


def inference(a):
    torch.manual_seed(a.seed)  # its own weights until the first version arrives
    model = LlamaForCausalLM().to(torch.bfloat16).eval()
    snk = wsync.Sink(a.local, hold_ttl=a.hold_ttl)
    snk.register(model, pack=not a.no_pack)
    say(event="registered")
    version = 0
    while version < a.until:
        snk.wait(version + 1, timeout=120)
        with snk.hold() as version:
            expect = torch.load(os.path.join(a.dir, f"expect-v{version}.pt"))
            state = model.state_dict()
            bad = [k for k in expect if not torch.equal(bits(state[k]), bits(expect[k]))]
            model.generate(torch.zeros(1, 1, dtype=torch.long), new_tokens=2)  # a batch under the hold
            if a.hold_forever:
                say(event="holding", version=version)
                time.sleep(3600)
        say(event="verified", version=version, mismatched=bad)
        open(os.path.join(a.dir, f"{a.name}.v{version}"), "w").close()
        if bad:
            sys.exit(1)
    say(event="done")


def split_trainer(a):
    """A trainer whose tensors two sources publish, half each (as two trainer
    ranks would): every step both publish the same version. With --pause-at V
    it publishes source A's part of V, then waits for DIR/resume before
    source B's (the test kills and restarts B's daemon meanwhile)."""
    torch.manual_seed(1234)
    model = LlamaForCausalLM()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    names = sorted(model.state_dict())
    half = len(names) // 2
    state = model.state_dict(keep_vars=True)  # the parameters themselves: registering rebinds them
    srcs = []
    for i, (local, group) in enumerate([(a.local, names[:half]), (a.local_b, names[half:])]):
        src = wsync.Source(local)
        src.register({n: state[n] for n in group}, part=(i, 2))
        srcs.append(src)
    say(event="registered", tensors=len(names))
    for step in range(a.steps):
        version = step + 1
        train_step(model, opt, a.dir, version)
        srcs[0].publish(version, wait=a.wait)
        if version == a.pause_at:
            say(event="paused", version=version)
            while not os.path.exists(os.path.join(a.dir, "resume")):
                time.sleep(0.05)
        srcs[1].publish(version, wait=a.wait)
        say(event="published", version=version)
        while a.lockstep and len(glob.glob(os.path.join(a.dir, f"*.v{version}"))) < a.lockstep:
            time.sleep(0.01)
    say(event="done")


def tp_inference(a):
    """An engine's rank through wsync.rank_sync.RankSync, the core of the vLLM
    and SGLang adapters: held except while syncing between steps."""
    torch.manual_seed(a.seed)  # its own weights until the first version arrives
    layout = layouts.tp_layout(tiny_config(), a.tp, a.rank)
    canonical = {k: v.to(torch.bfloat16) for k, v in LlamaForCausalLM().state_dict().items()}
    runtime = layouts.shard(canonical, layout)  # the engine's parameters
    rank = RankSync(runtime, layout, a.local, timeout=120)
    say(event="registered", tensors=len(runtime))
    version = 0
    while version < a.until:
        version = rank.sync(version + 1, timeout=120)
        torch.save({k: v.clone() for k, v in runtime.items()}, os.path.join(a.dir, f"{a.name}.v{version}.pt"))
        say(event="held", version=version)
        open(os.path.join(a.dir, f"{a.name}.v{version}"), "w").close()
    rank.close()
    say(event="done")


def mismatched(a):
    model = LlamaForCausalLM(Config(hidden_size=96, num_attention_heads=4, num_key_value_heads=2)).to(torch.bfloat16)
    snk = wsync.Sink(a.local)
    t0 = time.monotonic()
    try:
        snk.register(model)
        say(event="registered")
        snk.wait(1, timeout=60)
        say(event="error", error="none", code="OK", seconds=time.monotonic() - t0)
    except wsync.WsyncError as e:
        say(event="error", error=e.message, code=e.code, cls=type(e).__name__, seconds=time.monotonic() - t0)
    time.sleep(a.linger)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("role")
    p.add_argument("local")
    p.add_argument("dir", nargs="?")
    p.add_argument("name", nargs="?")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--until", type=int, default=8)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--no-pack", action="store_true")
    p.add_argument("--lockstep", type=int, default=0)
    p.add_argument("--wait", type=float, default=60.0)
    p.add_argument("--hold-ttl", type=float, default=None)
    p.add_argument("--hold-forever", action="store_true")
    p.add_argument("--linger", type=float, default=0.0)
    p.add_argument("--serve-tp", default="")
    p.add_argument("--pause-after", type=int, default=0)
    p.add_argument("--lockstep-after-pause", type=int, default=0)
    p.add_argument("--serve-offered", action="store_true")
    p.add_argument("--resize-at", type=int, default=0)
    p.add_argument("--resize-tp", default="")
    p.add_argument("--resize-lockstep", type=int, default=0)
    p.add_argument("--local-b", default="")
    p.add_argument("--pause-at", type=int, default=0)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    a = p.parse_args()
    {"trainer": trainer, "inference": inference, "mismatched": mismatched, "tp_inference": tp_inference,
     "split_trainer": split_trainer}[a.role](a)


if __name__ == "__main__":
    main()
