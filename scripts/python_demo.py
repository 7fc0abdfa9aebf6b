#!/usr/bin/python3
"""The Python examples against the real system on loopback: a coordinator, a
source and two sinks (wsyncd processes), examples/trainer.py publishing every
optimizer step through `wsync.Source`, and two examples/inference.py servers
syncing through `wsync.Sink`, each holding its weights around every batch.
Uses the installed `wsync` package (scripts/install-python.sh).

    python_demo.py --build BUILD [--steps 6]
"""
import argparse
import os
import subprocess
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from system_demo import System  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", required=True)
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="wsync_python_demo_")
    s = System(a.build, 2, 2, tmp)
    ok = False
    examples = os.path.join(HERE, "..", "examples")
    try:
        for n in s.sinks:
            s.wait_for(lambda: os.path.exists(f"{tmp}/{n}.sock"), f"{n}'s local API")
        servers = [subprocess.Popen(["/usr/bin/python3", os.path.join(examples, "inference.py"), "--local",
                                     f"unix:{tmp}/{n}.sock", "--until", str(a.steps)],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=s.env)
                   for n in s.sinks]
        s.wait_for(lambda: os.path.exists(f"{tmp}/source.sock"), "the source's local API")
        trainer = subprocess.run(["/usr/bin/python3", os.path.join(examples, "trainer.py"), "--local",
                                  f"unix:{tmp}/source.sock", "--steps", str(a.steps)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=s.env, timeout=300)
        print("trainer:\n  " + trainer.stdout.strip().replace("\n", "\n  "))
        for n, server in zip(s.sinks, servers):
            out, _ = server.communicate(timeout=120)
            print(f"inference server on {n}:\n  " + out.strip().replace("\n", "\n  "))
            if server.returncode != 0:
                raise SystemExit(f"inference server on {n} failed")
        if trainer.returncode != 0:
            raise SystemExit("trainer failed")
        ok = True
    finally:
        s.stop()
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"logs: {tmp}", flush=True)


if __name__ == "__main__":
    main()
