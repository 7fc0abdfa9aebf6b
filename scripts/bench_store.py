#!/usr/bin/python3
"""Versions through an object store against the daemon tree, in one run on
loopback: a source publishing the snapshots of SNAPSHOT_DIR, SINKS sinks
in the UCX tree and PULLERS `wsync store pull --follow` processes reading
a real S3-compatible server (SeaweedFS) with read-only credentials. Per
version: the time from the publish call to every sink and to every
puller, and what a puller read (bytes, requests). Then the cost model of a
real deployment at the measured ratio.

    bench_store.py --build BUILD (--data SNAPSHOT_DIR | --params N [--steps K] [--lr LR])
                   [--sinks 4] [--pullers 4]

--params: a synthetic set of N parameters (FP32 masters, Adam-like steps,
`wsync-bench synth`) instead of snapshots.
"""
import argparse
import glob
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from seaweedfs import READER, WRITER, SeaweedFS  # noqa: E402
from system_demo import System  # noqa: E402

RUN = "runs/bench"


class Puller:
    """A `wsync store pull --follow` process; its lines, timestamped."""

    def __init__(self, wsync, url, out, env):
        self.proc = subprocess.Popen([wsync, "store", "pull", "--store", url, "--run", RUN, "-o", out, "--follow",
                                      "--poll-ms", "20"], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        self.seen = {}  # version -> (time, bytes, requests)
        self.cv = threading.Condition()
        threading.Thread(target=self.read, daemon=True).start()

    def read(self):
        for line in self.proc.stdout:
            words = line.replace("(", " ").replace(")", " ").replace(",", " ").split()
            if "version" not in words:
                continue
            v = int(words[words.index("version") + 1])
            nbytes = int(words[words.index("bytes") - 1]) if "bytes" in words else 0
            reqs = int(words[words.index("requests") - 1]) if "requests" in words else 0
            with self.cv:
                self.seen[v] = (time.time(), nbytes, reqs)
                self.cv.notify_all()

    def wait(self, version, timeout=60):
        with self.cv:
            if not self.cv.wait_for(lambda: max(self.seen, default=0) >= version, timeout):
                raise RuntimeError(f"a puller did not reach version {version}")
            return self.seen[max(self.seen)]

    def stop(self):
        self.proc.kill()
        self.proc.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--data", help="a directory of safetensors snapshots")
    ap.add_argument("--params", type=int, help="a synthetic set of this many parameters instead")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", default="1e-6")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--pullers", type=int, default=4)
    ap.add_argument("--fanout", type=int, default=2)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="wsync_bench_store_")
    if args.params:
        data = os.path.join(tmp, "snaps")
        subprocess.run([os.path.join(args.build, "bench", "wsync-bench"), "--repeat", "1", "synth", "--params",
                        str(args.params), "--steps", str(args.steps), "--lr", args.lr, "--out", data],
                       check=True, stdout=subprocess.DEVNULL)
        args.data = f"a synthetic set (wsync-bench synth --params {args.params}, lr {args.lr})"
    elif args.data:
        data = args.data
    else:
        sys.exit("--data or --params")
    snaps = sorted(glob.glob(os.path.join(data, "*.safetensors")))
    store = SeaweedFS(tmp)
    system, pullers = None, []
    try:
        store.create_bucket("weights")
        url = store.url("weights")
        os.environ.update(AWS_ACCESS_KEY_ID=WRITER[0], AWS_SECRET_ACCESS_KEY=WRITER[1])
        system = System(args.build, args.sinks, args.fanout, tmp,
                        source_args=("--store", url, "--store-run", RUN, "--store-keyframe-every", "1000"))
        system.attach_buffers(snaps[0])
        wsync = os.path.join(args.build, "client", "wsync")
        pullers = [Puller(wsync, url, os.path.join(tmp, f"puller-{i}.safetensors"), SeaweedFS.env(READER))
                   for i in range(args.pullers)]
        print(f"{len(snaps)} snapshots of {os.path.getsize(snaps[0]) / 1e9:.2f} GB, {args.data}; {args.sinks} sinks in the tree (fan-out {args.fanout}), "
              f"{args.pullers} pullers of SeaweedFS on loopback")
        print(f"{'version':>7} {'patch B':>10} {'dense B':>11} {'tree ms':>8} {'store ms':>9} "
              f"{'read B/puller':>14} {'requests/puller':>16}")
        rows = []
        for i, snap in enumerate(snaps):
            v = i + 1
            t0 = time.time()
            patch, dense = system.publish(snap, v)
            system.wait_for(lambda: len(system.applied()) == args.sinks and
                            all(x >= v for x in system.applied().values()), f"version {v} on every sink", 60)
            tree = time.time() - t0
            seen = [p.wait(v) for p in pullers]
            stored = max(s[0] for s in seen) - t0
            read = statistics.median(s[1] for s in seen)
            reqs = statistics.median(s[2] for s in seen)
            rows.append((v, patch, dense, tree, stored, read, reqs))
            print(f"{v:>7} {patch:>10} {dense:>11} {tree * 1e3:>8.0f} {stored * 1e3:>9.0f} {read:>14.0f} {reqs:>16.0f}")
        steady = rows[1:]
        med = lambda k: statistics.median(r[k] for r in steady)  # noqa: E731
        ratio = med(2) / med(1)
        print(f"medians of versions 2..{len(rows)}: patch {med(1):.0f} B ({ratio:.0f}x), to every sink "
              f"{med(3) * 1e3:.0f} ms through the tree, {med(4) * 1e3:.0f} ms through the store; a puller read "
              f"{med(5):.0f} B in {med(6):.0f} requests per version (plus 2 per poll: the head and the next manifest)")
        dense_7b = 7e9 * 2
        patch_7b = dense_7b / ratio
        ranges = -(-patch_7b // (8 << 20))
        print(f"cost model, a 7B BF16 model at this ratio: {patch_7b / 1e6:.0f} MB stored per version (a keyframe "
              f"every K versions adds {dense_7b / 1e9:.0f} GB / K); per puller per version about "
              f"{int(ranges) + 2 + 2} requests (the manifest, a HEAD, {int(ranges)} ranged GETs of 8 MiB, the head "
              f"poll); egress for 1,000 pullers per step {patch_7b * 1000 / 1e9:.0f} GB")
    finally:
        for p in pullers:
            p.stop()
        if system:
            system.stop()
        store.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
