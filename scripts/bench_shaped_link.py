#!/usr/bin/python3
"""End-to-end over a shaped link: a source and a sink in two network
namespaces joined by a veth pair shaped with `tc ... tbf rate RATE`
(UCX_TLS=tcp), syncing a synthetic model (FP32 masters, Adam-like steps,
BF16 snapshots) version by version. Measured in the same run: the time per
version with wsync (the source's publish to the sink's apply), serial
(whole versions, encode, transfer and apply in turn) and streamed (the
default: versions sent in segments as they are encoded, decoded as they
arrive), and the time of a dense full copy of the same snapshot over the
same link (TCP). Needs root (ip netns, tc).

    bench_shaped_link.py --build BUILD [--params 536870912] [--steps 3] [--rate 1gbit]
"""
import argparse
import datetime
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

NS_A, NS_B = "wsync_bench_a", "wsync_bench_b"
IP_A, IP_B = "10.77.0.1", "10.77.0.2"


def sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def setup_link(rate):
    teardown_link()
    sh("ip", "netns", "add", NS_A)
    sh("ip", "netns", "add", NS_B)
    sh("ip", "link", "add", "wsbva", "type", "veth", "peer", "name", "wsbvb")
    sh("ip", "link", "set", "wsbva", "netns", NS_A)
    sh("ip", "link", "set", "wsbvb", "netns", NS_B)
    for ns, dev, ip in ((NS_A, "wsbva", IP_A), (NS_B, "wsbvb", IP_B)):
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/24", "dev", dev)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
           "burst", "512kb", "latency", "100ms")


def teardown_link():
    sh("ip", "netns", "del", NS_A, check=False)
    sh("ip", "netns", "del", NS_B, check=False)


# The sink's log line for an applied version (daemon/sink_core.cc), and the
# source's for a published one (daemon/source_core.cc), with their times.
STAMP = r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})"
APPLIED = re.compile(STAMP + r".*version (\d+) applied from \S+ \(\w+ \d+ bytes, ([\d.]+) ms: transfer ([\d.]+) ms, "
                     r"apply ([\d.]+) ms\)")
PUBLISHED = re.compile(STAMP + r".*version (\d+) published: .*encoded in ([\d.]+) ms")


def stamp(text):
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%f").timestamp()


def link_bits_per_second(rate):
    m = re.fullmatch(r"([\d.]+)([kmg]?)bit", rate.lower())
    if not m:
        raise ValueError(f"rate {rate}: expected e.g. 1gbit, 500mbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def dense_copy_seconds(path):
    """Sends the file's bytes from A to B over TCP; returns seconds."""
    size = os.path.getsize(path)
    recv = subprocess.Popen(["ip", "netns", "exec", NS_B, sys.executable, "-c", f"""
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("{IP_B}", 9977)); s.listen(1)
print("ready", flush=True)
c, _ = s.accept(); n = 0
while True:
    b = c.recv(1 << 20)
    if not b: break
    n += len(b)
print(n, flush=True)
"""], stdout=subprocess.PIPE, text=True)
    assert recv.stdout.readline().strip() == "ready"
    t0 = time.time()
    sh("ip", "netns", "exec", NS_A, sys.executable, "-c", f"""
import socket
c = socket.create_connection(("{IP_B}", 9977))
with open("{path}", "rb") as f:
    while True:
        b = f.read(1 << 22)
        if not b: break
        c.sendall(b)
c.close()
""")
    got = int(recv.stdout.readline())
    recv.wait()
    assert got == size, (got, size)
    return time.time() - t0


def run_phase(args, tmp, snaps, source_flags, sink_flags):
    """Coordinator, source and sink from scratch; publishes every snapshot.
    Returns the rows (version, wire bytes, encode s, time to sync s,
    transfer s, apply s) and whether the sink's last version is bit-exact.
    Time to sync: from the start of the source's publish to the sink's
    apply (both daemons' log times: one clock)."""
    wsync = os.path.join(args.build, "client", "wsync")
    wsyncd = os.path.join(args.build, "daemon", "wsyncd")
    tmp = tempfile.mkdtemp(prefix="phase_", dir=tmp)
    env = dict(os.environ, UCX_TLS="tcp", WSYNC_COORDINATOR=f"unix:{tmp}/coord.sock")
    procs = []

    def spawn(name, argv, ns=None):
        log = open(os.path.join(tmp, name + ".log"), "w")
        full = (["ip", "netns", "exec", ns] if ns else []) + argv
        procs.append(subprocess.Popen(full, env=env, stdout=log, stderr=subprocess.STDOUT))

    def applied():
        p = subprocess.run([wsync, "status", "--json"], env=env, capture_output=True, text=True)
        if p.returncode != 0:
            return 0
        nodes = json.loads(p.stdout).get("nodes", [])
        return min([int(n.get("appliedVersion", 0)) for n in nodes if n["role"] == "ROLE_SINK"] or [0])

    def wait_applied(v, timeout=600):
        end = time.time() + timeout
        while time.time() < end:
            if applied() >= v:
                return
            time.sleep(0.02)
        raise RuntimeError(f"version {v} not applied; logs in {tmp}")

    try:
        spawn("coordinator", [wsyncd, "coordinator", "--listen", f"unix:{tmp}/coord.sock"])
        time.sleep(0.5)
        spawn("source", [wsyncd, "source", "--name", "source", "--local", f"unix:{tmp}/src.sock",
                         "--listen", f"{IP_A}:0"] + source_flags, NS_A)
        spawn("sink", [wsyncd, "sink", "--name", "sink", "--local", f"unix:{tmp}/sink.sock",
                       "--listen", f"{IP_B}:0"] + sink_flags, NS_B)
        time.sleep(1.0)
        spawn("buffers", [wsync, "serve-buffers", "--local", f"unix:{tmp}/sink.sock", "--like", snaps[0]], NS_B)
        time.sleep(1.0)
        rows = []
        for i, snap in enumerate(snaps):
            v = i + 1
            # `wsync publish` copies the file into shared memory first (what a
            # trainer's optimizer step does in place): not counted. Counted:
            # the source's snapshot + encode, then the sink's pull + apply.
            p = subprocess.run([wsync, "publish", "--local", f"unix:{tmp}/src.sock", snap, "--version", str(v)],
                               env=env, capture_output=True, text=True)
            if p.returncode != 0:
                raise RuntimeError(p.stderr)
            words = p.stdout.split()
            wire, encode_ms = int(words[3]), float(words[-2])
            wait_applied(v)
            done = published = None
            for line in open(os.path.join(tmp, "sink.log")):
                m = APPLIED.search(line)
                if m and int(m.group(2)) == v:
                    done = (stamp(m.group(1)), float(m.group(4)) / 1000, float(m.group(5)) / 1000)
            for line in open(os.path.join(tmp, "source.log")):
                m = PUBLISHED.search(line)
                if m and int(m.group(2)) == v:
                    published = stamp(m.group(1)) - float(m.group(3)) / 1000
            if done is None or published is None:
                raise RuntimeError(f"no log line of version {v} in {tmp}/sink.log or source.log")
            rows.append((v, wire, encode_ms / 1000, done[0] - published, done[1], done[2]))
        last = subprocess.run([wsync, "dump", "--local", f"unix:{tmp}/sink.sock", "-o", f"{tmp}/last.safetensors",
                               "--version", str(len(snaps))], env=env, capture_output=True, text=True)
        if last.returncode != 0:
            raise RuntimeError(last.stderr)
        subprocess.run([wsync, "diff", f"{tmp}/last.safetensors", snaps[-1], "-o", f"{tmp}/zero"],
                       check=True, capture_output=True, text=True)
        zero = json.loads(subprocess.run([wsync, "inspect", f"{tmp}/zero", "--json"], capture_output=True,
                                         text=True).stdout)["changed"] == 0
        return rows, zero
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--params", type=int, default=536870912)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", default="1e-6")
    ap.add_argument("--rate", default="1gbit")
    args = ap.parse_args()
    bench = os.path.join(args.build, "bench", "wsync-bench")
    tmp = tempfile.mkdtemp(prefix="wsync_shaped_")
    snaps_dir = os.path.join(tmp, "snaps")
    print(f"generating {args.steps + 1} snapshots of {args.params} parameters (lr {args.lr}) ...", flush=True)
    sh(bench, "--repeat", "1", "synth", "--params", str(args.params), "--steps", str(args.steps),
       "--lr", args.lr, "--out", snaps_dir)
    snaps = sorted(os.path.join(snaps_dir, f) for f in os.listdir(snaps_dir))
    dense = os.path.getsize(snaps[0])
    setup_link(args.rate)
    try:
        # The same snapshots over the same link: encode, transfer and apply
        # one after the other (whole versions, decoded once in), then the
        # default pipeline (versions streamed in segments as they are
        # encoded, decoded while they arrive).
        phases = [("serial (--segment-mib 0, --no-decode-ahead)",
                   *run_phase(args, tmp, snaps, ["--segment-mib", "0"], ["--no-decode-ahead"])),
                  ("streamed (default)", *run_phase(args, tmp, snaps, [], []))]
        dense_s = [dense_copy_seconds(snaps[-1]) for _ in range(2)]
        dense_t = statistics.median(dense_s)
        print(f"link: veth + tbf {args.rate}; model: {dense / 1e9:.2f} GB BF16 ({args.params} parameters), lr {args.lr}")
        summary = []
        for name, rows, zero in phases:
            print(f"{name}:")
            print(f"{'version':>7} {'wire bytes':>12} {'encode s':>9} {'transfer s':>11} {'apply s':>8} {'to sync s':>10}")
            for v, wire, enc, sync, transfer, apply in rows:
                print(f"{v:>7} {wire:>12} {enc:>9.3f} {transfer:>11.3f} {apply:>8.3f} {sync:>10.3f}"
                      f"{'  (keyframe)' if v == 1 else ''}")
            print(f"  last version on the sink bit-exact: {'yes' if zero else 'NO'}")
            patch_rows = rows[1:]
            med = lambda f: statistics.median(f(r) for r in patch_rows)
            summary.append((name, med(lambda r: r[3]), med(lambda r: r[2]), med(lambda r: r[4]), med(lambda r: r[5]),
                            med(lambda r: r[2] + r[4] + r[5])))
        print(f"dense full copy over the same link: {dense_t:.2f} s (median of {len(dense_s)})")
        print("medians over the patches (transfer: the sink's request to its last byte; apply: after the last byte)")
        for name, sync_t, enc_t, transfer_t, apply_t, sum_t in summary:
            print(f"  {name}: time to sync {sync_t:.3f} s ({dense_t / sync_t:.1f}x less than dense); "
                  f"encode {enc_t:.3f} + transfer {transfer_t:.3f} + apply {apply_t:.3f} = {sum_t:.3f} s")
        serial, streamed = summary[0][1], summary[1][1]
        print(f"streamed: time to sync {streamed:.3f} s against {serial:.3f} s serial "
              f"({(1 - streamed / serial) * 100:.0f}% less); the serial stages sum to {summary[0][5]:.3f} s")
    finally:
        teardown_link()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
