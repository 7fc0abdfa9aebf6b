#!/usr/bin/python3
"""The trainer's wait per step through the Python client against the same
through the C++ CLI, in one run, on a BF16 model of `--gib` GiB (real
processes: a coordinator and a source on loopback).

    bench/python_client_bench.py --build BUILD [--gib 1] [--steps 5]

Per step about 1.5% of the elements change (+-1 unit in the last place, as
an RL optimizer step at lr 1e-6 does in BF16). For each method it reports
the trainer's wait for publish (median over steps), the daemon's own time
for the same publish, and their difference: what the client adds. The
Python client registers the model once (moved into shared memory and
rebound), so a step adds no copy: its overhead is one local gRPC call,
independent of the model size. `wsync publish` (the CLI stand-in) registers
a checkpoint file every time: it maps the file and copies it into fresh
shared memory per step.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
from system_demo import System, write_safetensors  # noqa: E402


def step(tensors, gen, fraction=0.015):
    """An optimizer step's worth of one-ulp changes, in place."""
    for t in tensors.values():
        bits = t.view(torch.int16).view(-1)
        idx = torch.randint(0, bits.numel(), (int(bits.numel() * fraction),), generator=gen)
        sign = torch.randint(0, 2, idx.shape, generator=gen, dtype=torch.int16) * 2 - 1
        bits[idx] += sign


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", required=True)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()
    sys.path.insert(0, os.path.join(os.path.abspath(a.build), "python"))
    import wsync

    gen = torch.Generator().manual_seed(0)
    n_tensors = 16
    per = int(a.gib * (1 << 30) / 2 / n_tensors)
    rows = 4096
    model = {f"layers.{i}.weight": (torch.randn(rows, per // rows, generator=gen) * 0.02).to(torch.bfloat16)
             for i in range(n_tensors)}
    dense = sum(t.numel() * 2 for t in model.values())
    tmp = tempfile.mkdtemp(prefix="wsync_pybench_")
    s = System(a.build, 0, 2, tmp)
    results = {}
    try:
        s.wait_for(lambda: os.path.exists(f"{tmp}/source.sock"), "the source's local API")
        src = wsync.Source(f"unix:{tmp}/source.sock", timeout=600)
        ptrs = {k: v.data_ptr() for k, v in model.items()}
        t0 = time.monotonic()
        src.register(model)
        register_s = time.monotonic() - t0
        moved = all(ptrs[k] != v.data_ptr() for k, v in model.items())
        ptrs = {k: v.data_ptr() for k, v in model.items()}
        src.publish()  # the first version: a keyframe, not timed
        for after_copy in (False, True):
            waits, daemon = [], []
            for _ in range(a.steps):
                step(model, gen)
                t0 = time.monotonic()
                st = src.publish(after_copy=after_copy)
                waits.append(time.monotonic() - t0)
                daemon.append(st.server_ms / 1000)
            src.publish()  # joins the last background publish (not timed)
            results[f"python{' --after-copy' if after_copy else ''}"] = (waits, daemon)
        same = all(ptrs[k] == v.data_ptr() for k, v in model.items())
        ckpt = os.path.join(tmp, "step.safetensors")
        for after_copy in (False, True):
            waits, daemon = [], []
            for _ in range(a.steps):
                step(model, gen)
                write_safetensors(ckpt, model)
                version = src.next_version
                src._next_version += 1
                t0 = time.monotonic()
                out = subprocess.run([s.wsync, "publish", "--local", f"unix:{tmp}/source.sock", ckpt, "--version",
                                      str(version), *(["--after-copy"] if after_copy else [])],
                                     capture_output=True, text=True, env=s.env)
                waits.append(time.monotonic() - t0)
                if out.returncode != 0:
                    raise SystemExit(out.stderr)
                words = out.stdout.split()
                daemon.append(float(words[words.index("in") + 1]) / 1000)  # its copy or encode
            results[f"CLI wsync publish{' --after-copy' if after_copy else ''}"] = (waits, daemon)
    finally:
        s.stop()
    print(f"model: {n_tensors} BF16 tensors, {dense / 1e9:.2f} GB; {a.steps} steps per method, medians")
    print(f"python register: {register_s:.2f} s (moves the tensors into shared memory once: "
          f"{'moved' if moved else 'NOT moved'}); tensor addresses unchanged across every publish: {same}")
    print("daemon s: the source's time in the call (Python: all of it; CLI: its copy or encode, as printed)")
    print(f"{'method':34} {'trainer waits s':>16} {'daemon s':>10} {'client adds s':>14}")
    for name, (waits, daemon) in results.items():
        w, d = statistics.median(waits), statistics.median(daemon)
        print(f"{name:34} {w:16.3f} {d:10.3f} {w - d:14.3f}")


if __name__ == "__main__":
    main()
