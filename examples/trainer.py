#!/usr/bin/python3
"""A trainer next to `wsyncd source`: AdamW on FP32 master weights, and a
publish after every optimizer step. The source casts the FP32 tensors to BF16
(what the inference servers run) and ships only what changed.

    examples/trainer.py --local unix:/run/wsync/source.sock --steps 8
"""
import argparse

import torch

import wsync
from tiny_llama import LlamaForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--local", default="unix:/run/wsync/source.sock")
p.add_argument("--steps", type=int, default=8)
p.add_argument("--lr", type=float, default=1e-5)
args = p.parse_args()

torch.manual_seed(0)
model = LlamaForCausalLM()                      # FP32 masters
opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

src = wsync.Source(args.local)
info = src.register(model)                      # moved into shared memory once; parameters rebound in place
print(f"registered {len(info.tensors)} tensors, {len(info.cast_to_bf16)} published as BF16; "
      f"next version {info.next_version}")

for step in range(args.steps):
    ids = torch.randint(0, model.config.vocab_size, (4, 32))
    loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
    stats = src.publish()                       # the next version; stats of the patch
    print(f"step {step}: loss {loss.item():.4f}, version {stats.version}: {stats.patch_bytes} bytes "
          f"({stats.ratio:.0f}x), {stats.encode_ms:.1f} ms")
