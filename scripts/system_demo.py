#!/usr/bin/python3
"""The real system on loopback: a coordinator, a source, N sinks (relay tree
of fan-out F, so some sinks sit behind a relay), one stand-in inference
server per sink owning its shared memory, and a trainer that publishes every
snapshot of a directory in order through the source. After each version
every sink's weights are dumped and compared bit for bit with the snapshot;
per version it prints bytes on the wire, ratio to dense and sync latency.

    system_demo.py --build BUILD --data DIR [--sinks 3] [--fanout 2]
"""
import argparse
import glob
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time


def tensor_digest(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    m = hashlib.sha256()
    for k in sorted(k for k in h if k != "__metadata__"):
        s, e = h[k]["data_offsets"]
        m.update(k.encode())
        m.update(h[k]["dtype"].encode())
        m.update(str(h[k]["shape"]).encode())
        m.update(b[8 + n + s:8 + n + e])
    return m.hexdigest()


def write_safetensors(path, tensors):
    """Writes {name: torch tensor} (BF16) as a safetensors file."""
    import torch
    header, offset = {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for t in tensors.values():
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes())


def free_ports(n):
    import socket
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class EtcdCluster:
    """An etcd cluster of `members` on loopback (Debian's etcd-server), in
    `tmp`; with `also_on` (an address of this host), clients reach the
    members there too, on the same ports."""

    def __init__(self, tmp, members=3, also_on=None):
        self.tmp = tmp
        self.also_on = also_on
        ports = free_ports(2 * members)
        self.names = [f"etcd-{i}" for i in range(members)]
        self.clients = [f"127.0.0.1:{ports[2 * i]}" for i in range(members)]
        self.peers = [f"http://127.0.0.1:{ports[2 * i + 1]}" for i in range(members)]
        self.procs = {}
        for i in range(members):
            self.start(i, new=True)
        self.wait_healthy()

    def argv(self, i, new):
        cluster = ",".join(f"{n}={p}" for n, p in zip(self.names, self.peers))
        listen = "http://" + self.clients[i]
        if self.also_on:
            listen += f",http://{self.also_on}:{self.clients[i].rsplit(':', 1)[1]}"
        return ["etcd", "--name", self.names[i], "--data-dir", f"{self.tmp}/{self.names[i]}.data",
                "--listen-client-urls", listen, "--advertise-client-urls", "http://" + self.clients[i],
                "--listen-peer-urls", self.peers[i], "--initial-advertise-peer-urls", self.peers[i],
                "--initial-cluster", cluster, "--initial-cluster-state", "new" if new else "existing",
                "--initial-cluster-token", "wsync-test", "--logger", "zap", "--log-outputs", "stderr"]

    def start(self, i, new=False):
        log = open(f"{self.tmp}/{self.names[i]}.log", "a")
        self.procs[i] = subprocess.Popen(self.argv(i, new), stdout=log, stderr=subprocess.STDOUT,
                                         env=dict(os.environ, ETCD_UNSUPPORTED_ARCH=os.environ.get("ETCD_UNSUPPORTED_ARCH", "")))

    def kill(self, i):
        p = self.procs[i]
        if p.poll() is None:
            p.kill()
            p.wait()

    def endpoints(self, host=None):
        """The members' client addresses (on `host` instead of 127.0.0.1)."""
        return ",".join(c if host is None else f"{host}:{c.rsplit(':', 1)[1]}" for c in self.clients)

    def ctl(self, *args):
        return subprocess.run(["etcdctl", "--endpoints", self.endpoints(), *args], capture_output=True, text=True,
                              env=dict(os.environ, ETCDCTL_API="3"))

    def get(self, key):
        p = self.ctl("get", key, "--print-value-only")
        return p.stdout.strip() if p.returncode == 0 else None

    def wait_healthy(self, timeout=60):
        end = time.time() + timeout
        while time.time() < end:
            if self.ctl("endpoint", "health").returncode == 0:
                return
            time.sleep(0.2)
        raise RuntimeError(f"etcd did not become healthy; logs in {self.tmp}")

    def stop(self):
        for i in list(self.procs):
            self.kill(i)


class System:
    """The processes of a wsync deployment on loopback, by name. With `etcd`
    (an EtcdCluster), `replicas` coordinator replicas over it instead of one
    coordinator, named coordinator-0.. (every client given all of them)."""

    def __init__(self, build, sinks, fanout, tmp, coordinator_args=(), source_args=(), device=-1, sink_args=(),
                 token=None, data_security=None, etcd=None, replicas=3, answer_proxies=False, source=True):
        self.wsync = os.path.join(build, "client", "wsync")
        self.wsyncd = os.path.join(build, "daemon", "wsyncd")
        self.tmp = tmp
        # device >= 0: the stand-in trainer and inference servers keep their
        # weights in that GPU's memory and share it over CUDA IPC.
        self.device_args = ["--device", str(device)] if device >= 0 else []
        self.replicas = [f"coordinator-{i}" for i in range(replicas)] if etcd else []
        listen = [f"unix:{tmp}/{r}.sock" for r in self.replicas] or [f"unix:{tmp}/coordinator.sock"]
        # answer_proxies: every client reaches each replica through an
        # AnswerProxy (the replica advertises the proxy's address), which can
        # be told to lose answers.
        self.proxies = {}
        coordinators = [f"unix:{tmp}/{r}-via.sock" for r in self.replicas] if answer_proxies else listen
        if answer_proxies:
            from answer_proxy import AnswerProxy
            for i, (r, front, back) in enumerate(zip(self.replicas, coordinators, listen)):
                self.proxies[r] = AnswerProxy(front, back, seed=i)
        self.env = dict(os.environ, UCX_TLS=os.environ.get("UCX_TLS", "tcp"), WSYNC_COORDINATOR=",".join(coordinators))
        if token:  # the cluster token: the coordinator's bearer token and the data plane's credential
            self.env["WSYNC_TOKEN"] = token
        security = ["--data-security", data_security] if data_security else []
        self.procs = {}  # name -> (argv, Popen)
        self.sinks = []
        self.sink_args = list(sink_args) + (["--data-security", data_security] if data_security else [])
        if etcd:
            for r, address, advertise in zip(self.replicas, listen, coordinators):
                self.spawn(r, [self.wsyncd, "coordinator", "--listen", address, "--advertise", advertise,
                               "--etcd", etcd.endpoints(), "--fanout", str(fanout), *coordinator_args])
        else:
            self.spawn("coordinator", [self.wsyncd, "coordinator", "--listen", f"unix:{tmp}/coordinator.sock",
                                       "--fanout", str(fanout), "--store-dir", f"{tmp}/store", *coordinator_args])
        self.wait_for(lambda: self.status() is not None, "coordinator")
        if source:
            self.spawn("source", [self.wsyncd, "source", "--name", "source", "--local", f"unix:{tmp}/source.sock",
                                  "--node-ttl-ms", "3000", *security, *source_args])
        for i in range(sinks):
            self.start_sink(f"sink-{i}")

    def start_sink(self, name):
        self.sinks.append(name)
        self.spawn(name, [self.wsyncd, "sink", "--name", name, "--local", f"unix:{self.tmp}/{name}.sock",
                          "--node-ttl-ms", "3000", *self.sink_args])

    def spawn(self, name, argv):
        log = open(os.path.join(self.tmp, name + ".log"), "a")
        self.procs[name] = (argv, subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT))

    def kill(self, name, sig=9):
        argv, p = self.procs[name]
        p.send_signal(sig)
        if sig in (9, 15):
            p.wait(timeout=10)

    def restart(self, name):
        argv, p = self.procs[name]
        if p.poll() is None:
            p.kill()
            p.wait()
        self.spawn(name, argv)

    def log(self, name):
        return open(os.path.join(self.tmp, name + ".log")).read()

    def status(self):
        p = subprocess.run([self.wsync, "status", "--json"], env=self.env, capture_output=True, text=True)
        return json.loads(p.stdout) if p.returncode == 0 else None

    def wait_for(self, pred, what, timeout=30):
        end = time.time() + timeout
        while time.time() < end:
            if pred():
                return
            time.sleep(0.05)
        raise RuntimeError(f"timed out waiting for {what}; logs in {self.tmp}")

    def attach_buffers(self, like, sinks=None):
        for s in sinks or self.sinks:
            self.wait_for(lambda: os.path.exists(f"{self.tmp}/{s}.sock"), f"{s}'s local API")
            self.spawn(f"{s}-buffers", [self.wsync, "serve-buffers", "--local", f"unix:{self.tmp}/{s}.sock",
                                        "--like", like, *self.device_args])

    def applied(self):
        st = self.status() or {}
        return {n["name"]: int(n.get("appliedVersion", 0)) for n in st.get("nodes", []) if n["role"] == "ROLE_SINK"}

    def parents(self):
        st = self.status() or {}
        return {n["name"]: n.get("parent", "") for n in st.get("nodes", []) if n["role"] == "ROLE_SINK"}

    def publish(self, path, version, wait_ms=0, after_copy=False):
        """Returns (patch bytes, dense bytes); patch bytes are 0 when the
        source returned after its copy (after_copy) and encodes in the background."""
        p = subprocess.run([self.wsync, "publish", "--local", f"unix:{self.tmp}/source.sock", path,
                            "--version", str(version), "--wait-ms", str(wait_ms), *self.device_args,
                            *(["--after-copy"] if after_copy else [])],
                           env=self.env, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(p.stderr.strip())
        words = p.stdout.split()
        if words[2] == "copied:":
            return 0, int(words[3])
        return int(words[3]), int(words[6])

    def dump(self, sink, out, version):
        p = subprocess.run([self.wsync, "dump", "--local", f"unix:{self.tmp}/{sink}.sock", "-o", out,
                            "--version", str(version), "--timeout-ms", "30000"],
                           env=self.env, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(p.stderr.strip())

    def source_bytes_served(self):
        out = subprocess.run([self.wsync, "local-status", "--local", f"unix:{self.tmp}/source.sock"],
                             env=self.env, capture_output=True, text=True).stdout.split()
        return int(out[6]) if len(out) > 6 else 0

    def verify(self, sink, snap, version):
        """Dumps `sink` once it holds `version`; True if bit-exact with `snap`."""
        out = os.path.join(self.tmp, f"{sink}.v{version}.safetensors")
        self.dump(sink, out, version)
        same = tensor_digest(out) == tensor_digest(snap)
        os.unlink(out)
        return same

    def stop(self):
        for argv, p in reversed(list(self.procs.values())):
            if p.poll() is None:
                p.terminate()
        for argv, p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        for proxy in self.proxies.values():
            proxy.stop()


def gpu_present():
    return shutil.which("nvidia-smi") is not None and \
        subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--sinks", type=int, default=3)
    ap.add_argument("--fanout", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep the logs")
    ap.add_argument("--device", type=int, default=-1,
                    help="GPU whose memory holds the trainer's and servers' weights (CUDA IPC); default: shared memory")
    ap.add_argument("--device-base", choices=["device", "host"],
                    help="with --device: where the source keeps the base of the next patch (wsyncd --device-base)")
    ap.add_argument("--token", help="cluster token (coordinator and data plane)")
    ap.add_argument("--data-security", choices=["none", "auth", "encrypt"],
                    help="what data-plane peers must prove (default: auth with a token, none without)")
    args = ap.parse_args()
    if args.device >= 0 and not gpu_present():
        print("SKIP: no GPU (nvidia-smi finds none)")
        sys.exit(0)
    snaps = sorted(glob.glob(os.path.join(args.data, "*.safetensors")))
    if len(snaps) < 2:
        sys.exit(f"no snapshots in {args.data}")
    tmp = tempfile.mkdtemp(prefix="wsync_system_")
    system = System(args.build, args.sinks, args.fanout, tmp, device=args.device, token=args.token,
                    data_security=args.data_security,
                    source_args=("--device-base", args.device_base) if args.device_base else ())
    ok = True
    try:
        system.attach_buffers(snaps[0])
        where = f"GPU {args.device} (CUDA IPC)" if args.device >= 0 else "shared memory"
        security = args.data_security or ("auth" if args.token else "none")
        print(f"{args.sinks} sinks, fan-out {args.fanout}, {len(snaps)} snapshots of {args.data}, weights in {where}, "
              f"data-plane security {security}")
        print(f"{'version':>7} {'wire bytes':>12} {'dense bytes':>12} {'ratio':>8} {'sync ms':>8}  bit-exact")
        for i, snap in enumerate(snaps):
            version = i + 1
            t0 = time.time()
            patch, dense = system.publish(snap, version)
            system.wait_for(lambda: all(v >= version for v in system.applied().values())
                            and len(system.applied()) == args.sinks, f"version {version} on every sink", 60)
            latency = (time.time() - t0) * 1000
            exact = [system.verify(s, snap, version) for s in system.sinks]
            if version == 1:
                served_after_keyframe = system.source_bytes_served()
            ok = ok and all(exact)
            print(f"{version:>7} {patch:>12} {dense:>12} {dense / patch:>7.1f}x {latency:>8.0f}  "
                  f"{'yes' if all(exact) else 'NO: ' + str(exact)}")
        total_served = system.source_bytes_served()
        print(f"bytes sent by the source: {total_served} in all, {total_served - served_after_keyframe} "
              f"for the patches of versions 2..{len(snaps)}")
        parents = system.parents()
        relayed = sorted(s for s, p in parents.items() if p.startswith("sink-"))
        print("parents: " + ", ".join(f"{s} <- {p}" for s, p in sorted(parents.items())))
        print(f"behind a relay: {', '.join(relayed) if relayed else 'none'}")
        if args.sinks > args.fanout and not relayed:
            ok = False
            print("expected sinks behind a relay")
    except Exception as e:  # noqa: BLE001
        ok = False
        print(f"FAILED: {e}")
    finally:
        system.stop()
        if ok and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"logs: {tmp}")
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
