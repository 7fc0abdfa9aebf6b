#!/usr/bin/python3
"""A fault campaign against the real system on loopback.

A coordinator (its store on a small tmpfs when one can be mounted), a source
and three sinks (fan-out 2: one behind a relay), each sink with a stand-in
inference server (`wsync serve-buffers`); a trainer in this process publishes
synthetic BF16 versions through the Python client (`wsync.Source`). Each round
injects one fault, chosen at random, at a random point (before a version is
published, or while the sinks are syncing it):

  kill_coordinator  SIGKILL and restart of the coordinator
  kill_source       SIGKILL and restart of the source
  kill_sink         SIGKILL and restart of a sink without children
  kill_relay        SIGKILL and restart of a sink that relays to another
  corrupt_chunks    the source restarted to corrupt every 5th chunk it sends
  swap_buffers      a sink's inference server replaced by one with mismatched
                    tensors (refused, naming the tensor), then the right one again
  disk_full         the coordinator's store fills up (publishes fail, nothing is
                    acknowledged), then space comes back
  slow_link         the source restarted with a rate limit of 4 MB/s per link

With --replicas, three coordinator replicas over a three-member etcd cluster
take the coordinator's place (kill_coordinator and disk_full do not apply),
and five more kinds join:

  kill_leader       SIGKILL of the leading replica, restarted as a follower
  pause_leader      SIGSTOP of the leading replica past its lease, then SIGCONT
  kill_etcd_member  SIGKILL of an etcd member while a version is published, then
                    its restart
  kill_replicas     SIGKILL and restart of every replica
  lose_answers      every client reaches the replicas through a proxy; for the
                    round (a version published and synced) it drops 30% of the
                    answers after the replica answered (the call took effect,
                    the caller sees UNAVAILABLE and retries)

After every round every sink must reach the head and hold the trainer's bits
exactly (dumped and compared bit for bit), every acknowledged version must
still be listed by the coordinator and no version number handed out twice,
and the daemons' file descriptors and memory must stay bounded.

    fault_campaign.py --build BUILD [--seed N] [--minutes M] [--rounds R] [--json FILE]

Without --seed a random seed is drawn and printed: rerun with it to replay.
"""
import argparse
import collections
import json
import os
import random
import signal
import statistics
import struct
import subprocess
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from system_demo import EtcdCluster, System, write_safetensors  # noqa: E402

KINDS = ["kill_coordinator", "kill_source", "kill_sink", "kill_relay", "corrupt_chunks", "swap_buffers",
         "disk_full", "slow_link"]
REPLICA_KINDS = ["kill_leader", "pause_leader", "kill_etcd_member", "kill_replicas", "lose_answers", "kill_source",
                 "kill_sink", "kill_relay", "corrupt_chunks", "swap_buffers", "slow_link"]
LOSE = 0.3  # lose_answers: the share of answers dropped
LEASE_S = 2  # the replicas' default leader lease
CONVERGE_S = 120
MAX_FDS = 256
MAX_RSS_MB = 512  # per daemon, for a 4 MiB model: growth without bound would cross it in a long run


def read_safetensors(path):
    """{name: bytes}, and the metadata."""
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    meta = h.pop("__metadata__", {})
    return {k: b[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]] for k, v in h.items()}, meta


def differing_bits(a, b):
    if len(a) != len(b):
        return 8 * max(len(a), len(b))
    x = int.from_bytes(a, "little") ^ int.from_bytes(b, "little")
    return bin(x).count("1")


class Campaign:
    def __init__(self, build, seed, tmp, token=None, data_security=None, source_args=(), kinds=None, replicas=False):
        import torch
        import wsync
        self.torch, self.wsync = torch, wsync
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.tmp = tmp
        self.tmpfs = False
        os.makedirs(f"{tmp}/store")
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", f"{tmp}/store"],
                          capture_output=True).returncode == 0:
            self.tmpfs = True
        every = REPLICA_KINDS if replicas else KINDS
        unknown = [k for k in (kinds or []) if k not in every]
        if unknown:
            raise SystemExit(f"fault kinds {unknown} do not apply (here: {','.join(every)})")
        self.kinds = [k for k in (kinds or every) if k != "disk_full" or self.tmpfs]
        self.etcd = EtcdCluster(tmp) if replicas else None
        self.model = {f"layers.{i}.weight": (torch.randn(256, 1024, generator=self.gen) * 0.02).to(torch.bfloat16)
                      for i in range(8)}
        self.like = f"{tmp}/like.safetensors"
        write_safetensors(self.like, self.model)
        self.mismatched = f"{tmp}/mismatched.safetensors"
        write_safetensors(self.mismatched, {**self.model, "layers.0.weight": torch.zeros(128, 1024, dtype=torch.bfloat16)})
        self.s = System(build, 3, 2, tmp, coordinator_args=["--node-ttl-ms", "3000"], token=token,
                        data_security=data_security, source_args=source_args, etcd=self.etcd,
                        answer_proxies=replicas)
        self.source_argv = list(self.s.procs["source"][0])
        for n in self.s.sinks:
            self.s.wait_for(lambda: os.path.exists(f"{tmp}/{n}.sock"), f"{n}'s local API")
        self.s.attach_buffers(self.like)
        self.wait_local("source")
        self.src = wsync.Source(f"unix:{tmp}/source.sock", timeout=30)
        self.src.register(self.model)
        self.acknowledged = []  # versions publish() returned
        self.refused = 0        # publishes refused (nothing acknowledged)
        self.faults = {k: 0 for k in every}
        self.converge = []      # seconds from each fault to every sink verified at the head
        self.divergent_bits = 0
        self.verified = 0
        self.peak = {}          # daemon -> (max fds, max RSS kB)
        self.baseline_rss = {}

    # ---- processes
    def local_ok(self, name):
        return subprocess.run([self.s.wsync, "local-status", "--local", f"unix:{self.tmp}/{name}.sock"],
                              env=self.s.env, capture_output=True).returncode == 0

    def wait_local(self, name):
        self.s.wait_for(lambda: self.local_ok(name), f"{name}'s local API", 60)

    def restart(self, name, argv=None):
        if argv is not None:
            self.s.procs[name] = (argv, self.s.procs[name][1])
        self.s.kill(name, signal.SIGKILL)
        self.s.restart(name)
        if name.startswith("coordinator"):
            self.s.wait_for(lambda: self.s.status() is not None, "the coordinator", 60)
        else:
            self.wait_local(name)

    def sample(self):
        for name, (_, p) in self.s.procs.items():
            if name.endswith("-buffers") or p.poll() is not None:
                continue
            try:
                nfd = len(os.listdir(f"/proc/{p.pid}/fd"))
                rss = next(int(line.split()[1]) for line in open(f"/proc/{p.pid}/status") if line.startswith("VmRSS"))
            except (FileNotFoundError, StopIteration, ProcessLookupError):
                continue
            old = self.peak.get(name, (0, 0))
            self.peak[name] = (max(old[0], nfd), max(old[1], rss))
            self.baseline_rss.setdefault(name, rss)

    # ---- the trainer
    def step(self):
        """An optimizer step's worth of one-ulp changes."""
        torch = self.torch
        for t in self.model.values():
            bits = t.view(torch.int16).view(-1)
            idx = torch.randint(0, bits.numel(), (bits.numel() // 100,), generator=self.gen)
            bits[idx] += (torch.randint(0, 2, idx.shape, generator=self.gen, dtype=torch.int16) * 2 - 1)

    def publish(self):
        self.step()
        try:
            v = self.src.publish(wait=30).version
        except self.wsync.WsyncError as e:
            self.refused += 1
            print(f"    publish refused ({e.code}): {e.message[:160]}", flush=True)
            return None
        if self.acknowledged and v <= self.acknowledged[-1]:
            raise AssertionError(f"version {v} handed out again (last acknowledged {self.acknowledged[-1]})")
        self.acknowledged.append(v)
        return v

    # ---- checks
    def converged(self, head):
        applied = self.s.applied()
        return all(applied.get(n, 0) >= head for n in self.s.sinks)

    def verify(self, head):
        """Every sink holds the trainer's bits of `head`; returns the time it took."""
        t0 = time.time()
        self.s.wait_for(lambda: self.converged(head), f"every sink at version {head}", CONVERGE_S)
        expect = {k: t.contiguous().view(self.torch.uint8).numpy().tobytes() for k, t in self.model.items()}
        for n in self.s.sinks:
            out = f"{self.tmp}/{n}.dump.safetensors"
            self.s.dump(n, out, head)
            got, meta = read_safetensors(out)
            os.unlink(out)
            if int(meta.get("wsync_version", 0)) != head:
                raise AssertionError(f"{n} dumped version {meta.get('wsync_version')}, not {head}")
            bits = sum(differing_bits(got.get(k, b""), v) for k, v in expect.items())
            self.divergent_bits += bits
            self.verified += 1
            if bits:
                raise AssertionError(f"{n} at version {head}: {bits} bits differ from the trainer's")
        return time.time() - t0

    def check_versions(self):
        out = subprocess.run([self.s.wsync, "versions", "--json"], env=self.s.env, capture_output=True, text=True)
        listed = {int(v["version"]) for v in json.loads(out.stdout).get("versions", [])}
        lost = [v for v in self.acknowledged if v not in listed]
        if lost:
            raise AssertionError(f"acknowledged versions lost by the coordinator: {lost}")

    # ---- faults
    def leader(self):
        """The leading replica's name (waiting for one)."""
        def find():
            address = self.etcd.get("/wsync/leader") or ""
            return next((r for r in self.s.replicas if address.endswith((f"/{r}.sock", f"/{r}-via.sock"))), None)
        self.s.wait_for(lambda: find() is not None, "a leading replica", 60)
        return find()

    def inject(self, kind):
        s = self.s
        if kind == "kill_coordinator":
            self.restart("coordinator")
        elif kind == "kill_leader":
            self.restart(self.leader())
        elif kind == "pause_leader":
            name = self.leader()
            s.kill(name, signal.SIGSTOP)
            time.sleep(LEASE_S + 1)
            s.kill(name, signal.SIGCONT)
        elif kind == "kill_etcd_member":
            member = self.rng.randrange(len(self.etcd.names))
            self.etcd.kill(member)
            self.publish()  # goes on with two members of three
            self.etcd.start(member)
            self.etcd.wait_healthy()
        elif kind == "kill_replicas":
            for r in s.replicas:
                s.kill(r, signal.SIGKILL)
            for r in s.replicas:
                s.restart(r)
            s.wait_for(lambda: s.status() is not None, "the replicas", 60)
        elif kind == "lose_answers":
            for proxy in s.proxies.values():
                proxy.lose = LOSE  # until the round's check is done
        elif kind == "kill_source":
            self.restart("source", self.source_argv)
        elif kind in ("kill_sink", "kill_relay"):
            parents = s.parents()
            relays = sorted({p for p in parents.values() if p in s.sinks})
            leaves = sorted(n for n in s.sinks if n not in relays)
            pool = relays if kind == "kill_relay" and relays else leaves
            self.restart(self.rng.choice(pool))
        elif kind == "corrupt_chunks":
            self.restart("source", self.source_argv + ["--inject-corrupt-every", "5"])
        elif kind == "slow_link":
            self.restart("source", self.source_argv + ["--rate-limit", "4000000"])
        elif kind == "swap_buffers":
            sink = self.rng.choice(s.sinks)
            _, p = s.procs[f"{sink}-buffers"]
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=10)
            bad = subprocess.run([s.wsync, "serve-buffers", "--local", f"unix:{self.tmp}/{sink}.sock", "--like",
                                  self.mismatched], env=s.env, capture_output=True, text=True, timeout=60)
            if bad.returncode == 0 or "'layers.0.weight'" not in bad.stderr:
                raise AssertionError(f"mismatched buffers on {sink} were not refused by name: {bad.stderr}")
            s.attach_buffers(self.like, [sink])
        elif kind == "disk_full":
            filler = f"{self.tmp}/store/filler"
            fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                while os.write(fd, b"\0" * 4096) > 0:
                    pass
            except OSError:
                pass  # full
            finally:
                os.close(fd)
            v = self.publish()  # the coordinator cannot log it: refused, or acknowledged only if it fit
            os.unlink(filler)
            if v is not None:
                print(f"    version {v} was acknowledged with the disk full (it fit)", flush=True)

    def round(self, i):
        kind = self.rng.choice(self.kinds)
        mid_sync = self.rng.random() < 0.5
        self.faults[kind] += 1
        if mid_sync:
            self.publish()
            t0 = time.time()
            self.inject(kind)
        else:
            t0 = time.time()
            self.inject(kind)
        # The next version published after the fault, then the round's check.
        head = self.publish()
        if head is None:
            head = self.publish()
        if kind in ("corrupt_chunks", "slow_link"):
            head = self.publish() or head  # a second version through the faulty link
        self.verify(head)
        for proxy in self.s.proxies.values():
            proxy.lose = 0
        took = time.time() - t0
        self.converge.append((took, kind))
        self.check_versions()
        self.sample()
        print(f"  round {i}: {kind}{' (mid-sync)' if mid_sync else ''}: every sink bit-exact at version {head} "
              f"{took:.1f} s after the fault", flush=True)

    def by_kind(self):
        """{fault kind: {"median": s, "worst": s, "n": rounds}} of the time to converge."""
        out = {}
        for kind in sorted({k for _, k in self.converge}):
            took = sorted(c for c, k in self.converge if k == kind)
            out[kind] = {"median": round(statistics.median(took), 2), "worst": round(took[-1], 2), "n": len(took)}
        return out

    def report(self, seed, elapsed):
        worst = max(self.converge) if self.converge else (0, "-")
        growth = {n: (self.peak[n][1] - self.baseline_rss.get(n, 0)) // 1024 for n in self.peak}
        r = {
            "seed": seed, "seconds": round(elapsed), "rounds": len(self.converge),
            "versions_acknowledged": len(self.acknowledged), "publishes_refused": self.refused,
            "sink_versions_verified": self.verified, "faults": self.faults, "divergent_bits": self.divergent_bits,
            "lost_versions": 0, "reused_versions": 0,
            "worst_converge_s": round(worst[0], 1), "worst_converge_fault": worst[1],
            "median_converge_s": round(sorted(c for c, _ in self.converge)[len(self.converge) // 2], 1)
            if self.converge else 0,
            "converge_s_by_fault": self.by_kind(),
            "max_fds": {n: p[0] for n, p in self.peak.items()},
            "max_rss_mb": {n: p[1] // 1024 for n, p in self.peak.items()},
            "rss_growth_mb": growth, "disk_full_tested": self.tmpfs and "disk_full" in self.kinds,
            "answers_lost": dict(sum((p.lost for p in self.s.proxies.values()), collections.Counter())),
        }
        if self.faults.get("lose_answers") and not r["answers_lost"]:
            raise AssertionError("lose_answers rounds ran but no answer was lost: the fault was not exercised")
        for n, (nfd, rss) in self.peak.items():
            if nfd > MAX_FDS:
                raise AssertionError(f"{n} held {nfd} file descriptors (bound {MAX_FDS})")
            if rss // 1024 > MAX_RSS_MB:
                raise AssertionError(f"{n} used {rss // 1024} MB (bound {MAX_RSS_MB} MB)")
        return r

    def stacks(self):
        """Every daemon's threads into its log folder (gdb, when installed), for a failure's report."""
        for name, (_, p) in self.s.procs.items():
            if name.endswith("-buffers") or p.poll() is not None:
                continue
            with open(f"{self.tmp}/{name}.stacks", "w") as f:
                subprocess.run(["gdb", "-p", str(p.pid), "-batch", "-ex", "thread apply all bt"], stdout=f,
                               stderr=subprocess.STDOUT, timeout=60, check=False)

    def close(self):
        try:
            self.s.stop()
            if self.etcd is not None:
                self.etcd.stop()
        finally:
            if self.tmpfs:
                subprocess.run(["umount", "-l", f"{self.tmp}/store"], capture_output=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", required=True)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--minutes", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=1000)
    p.add_argument("--json", default=None)
    p.add_argument("--token", default=None, help="cluster token (coordinator and data plane)")
    p.add_argument("--data-security", choices=["none", "auth", "encrypt"], default=None)
    p.add_argument("--kinds", default=None, help=f"comma-separated fault kinds (default: all of {','.join(KINDS)}, "
                                                 f"with --replicas {','.join(REPLICA_KINDS)})")
    p.add_argument("--replicas", action="store_true",
                   help="three coordinator replicas over a three-member etcd cluster (Debian's etcd-server)")
    p.add_argument("--segment-mib", default=None,
                   help="the source's --segment-mib (1: the 4 MB model's versions are streamed in segments)")
    a = p.parse_args()
    sys.path.insert(0, os.path.join(os.path.abspath(a.build), "python"))
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 31)
    security = f" --token TOKEN --data-security {a.data_security}" if a.data_security else ""
    if a.segment_mib:
        security += f" --segment-mib {a.segment_mib}"
    if a.replicas:
        security += " --replicas"
    print(f"fault campaign: seed {seed} (replay: fault_campaign.py --build {a.build} --seed {seed}{security}), "
          f"{a.minutes} min", flush=True)
    tmp = tempfile.mkdtemp(prefix=f"wsync_campaign_{seed}_")
    c = Campaign(a.build, seed, tmp, token=a.token, data_security=a.data_security,
                 source_args=["--segment-mib", a.segment_mib] if a.segment_mib else [],
                 kinds=a.kinds.split(",") if a.kinds else None, replicas=a.replicas)
    t0 = time.time()
    try:
        first = c.publish()
        c.verify(first)
        c.sample()
        i = 0
        while i < a.rounds and time.time() - t0 < a.minutes * 60:
            i += 1
            c.round(i)
        r = c.report(seed, time.time() - t0)
    except BaseException:
        print(f"fault campaign FAILED with seed {seed}; logs in {tmp}", flush=True)
        c.stacks()
        raise
    finally:
        c.close()
    shutil.rmtree(tmp, ignore_errors=True)  # kept only when the campaign failed (above)
    print(json.dumps(r, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    print(f"PASS: {r['rounds']} faults, {r['versions_acknowledged']} versions, {r['sink_versions_verified']} sink "
          f"versions verified bit-exact, divergent bits {r['divergent_bits']}, lost versions 0, worst convergence "
          f"{r['worst_converge_s']} s ({r['worst_converge_fault']})")
    if r["answers_lost"]:
        print("  answers lost after the replica answered (then retried): " +
              ", ".join(f"{m} {n}" for m, n in sorted(r["answers_lost"].items())))
    for kind, c in r["converge_s_by_fault"].items():
        print(f"  {kind:17s} {c['n']:4d} faults: converged in {c['median']:.2f} s median, {c['worst']:.2f} s worst")


if __name__ == "__main__":
    main()
