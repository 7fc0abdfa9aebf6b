#!/usr/bin/python3
"""An inference server next to `wsyncd sink`: its BF16 model is registered in
place, and each batch runs under a hold, so a new version is applied only
between batches, never during one.

    examples/inference.py --local unix:/run/wsync/sink.sock --until 8
"""
import argparse

import torch

import wsync
from tiny_llama import LlamaForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--local", default="unix:/run/wsync/sink.sock")
p.add_argument("--until", type=int, default=8, help="stop once this version has been served")
args = p.parse_args()

model = LlamaForCausalLM().to(torch.bfloat16).eval()   # its own weights, replaced by the trainer's
snk = wsync.Sink(args.local)
snk.register(model)                                    # the sink writes these tensors

version = 0
while version < args.until:
    snk.wait(version + 1, timeout=60)                  # a newer version is applied
    with snk.hold() as version:                        # the sink applies nothing until the block ends
        out = model.generate(torch.zeros(1, 1, dtype=torch.long), new_tokens=8)
    print(f"version {version}: generated {out[0].tolist()}")
