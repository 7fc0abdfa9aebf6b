#!/usr/bin/python3
"""Versions through a real S3-compatible server (SeaweedFS on loopback): a
source mirrors every version it publishes (wsyncd source --store); pullers
that reach no daemon and hold read-only credentials follow the run with
`wsync store pull`, bit for bit with the trainer's snapshots. The store
stopped while the trainer publishes (its publishes do not wait for it; the
version it missed is dropped and the next goes up with a keyframe), a
puller that starts late or from an old file, one behind a proxy that
answers some ranged GETs with 503 or cuts them short, a region with its
own coordinator whose gateway publishes what it pulls to the region's
sinks (one behind the other), and sinks of the trainer's cluster that
cannot reach its source (a network namespace of their own: they reach the
coordinator and the store only) and read the store when no daemon serves
them a version, relaying to each other.

    store_test.py BUILD SNAPSHOT_DIR
"""
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))
from netns import Link  # noqa: E402
from s3_fault_proxy import S3FaultProxy  # noqa: E402
from seaweedfs import READER, WRITER, SeaweedFS  # noqa: E402
from system_demo import System, tensor_digest  # noqa: E402

RUN = "runs/store-test"


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print(f"  ok: {what}", flush=True)


def main():
    build, data = sys.argv[1], sys.argv[2]
    snaps = sorted(glob.glob(os.path.join(data, "*.safetensors")))
    tmp = tempfile.mkdtemp(prefix="wsync_store_")
    store = SeaweedFS(tmp, bind="0.0.0.0")
    system = link = None
    ok = False
    try:
        store.create_bucket("weights")
        url = store.url("weights")
        wsync = os.path.join(build, "client", "wsync")
        reader_env = SeaweedFS.env(READER)

        def pull(out, *extra, timeout=120, key=None):
            p = subprocess.run([wsync, "store", "pull", "--store", url, "--run", RUN, "-o", out,
                                "--verify-key", key or pub, *extra],
                               env=reader_env, capture_output=True, text=True, timeout=timeout)
            if p.returncode != 0:
                raise RuntimeError(p.stderr.strip())
            return p.stdout

        # The source writes with the writer's credentials (its environment).
        os.environ.update(AWS_ACCESS_KEY_ID=WRITER[0], AWS_SECRET_ACCESS_KEY=WRITER[1])
        # The run's signing key (the source's) and its public key (the pullers').
        key, pub, other = (os.path.join(tmp, n) for n in ("run.pem", "run.pub.pem", "other.pub.pem"))
        subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", key], check=True)
        subprocess.run(["openssl", "pkey", "-in", key, "-pubout", "-out", pub], check=True)
        subprocess.run(f"openssl genpkey -algorithm ed25519 | openssl pkey -pubout -out {other}", shell=True,
                       check=True)
        # Short request timeouts for the source, so that a stopped store fails its uploads quickly.
        system = System(build, 0, 2, tmp, source_args=("--store", url + "&attempts=2&timeout_ms=1000", "--store-run",
                                                      RUN, "--store-keyframe-every", "4", "--store-merge-every", "3",
                                                      "--store-signing-key", key))
        # Sinks of the cluster in a network namespace: they reach the coordinator (a unix socket)
        # and the store (over the veth pair), not the source's data plane (its 127.0.0.1). Each
        # tries its parent first and reads the store when no daemon serves it the version; a
        # sink whose parent is one of them waits for it (--store-wait-ms) and is relayed to.
        link = Link("store", 78)
        far_url = store.url("weights", link.HOST) + "&attempts=2&timeout_ms=1000"
        far = [f"far-{i}" for i in range(3)]
        for name in far:
            system.sinks.append(name)
            system.spawn(name, link.inside([
                "env", f"AWS_ACCESS_KEY_ID={READER[0]}", f"AWS_SECRET_ACCESS_KEY={READER[1]}", system.wsyncd, "sink",
                "--name", name, "--local", f"unix:{tmp}/{name}.sock", "--node-ttl-ms", "3000", "--retry-max-ms",
                "2000", "--store", far_url, "--store-run", RUN, "--store-verify-key", pub, "--store-wait-ms",
                "30000"]))
        system.attach_buffers(snaps[0], sinks=far)
        # A region that reads the store: its coordinator announces the run's versions from the
        # store, its sinks read the store (one of them; the other is relayed to). No source, no
        # gateway, read-only credentials.
        os.environ.update(AWS_ACCESS_KEY_ID=READER[0], AWS_SECRET_ACCESS_KEY=READER[1])
        follow_tmp = os.path.join(tmp, "follow")
        os.makedirs(follow_tmp)
        follow = System(build, 2, 1, follow_tmp, source=False,
                        coordinator_args=("--follow-store", url, "--store-run", RUN, "--store-verify-key", pub,
                                          "--store-poll-ms", "100"),
                        sink_args=("--store", url, "--store-run", RUN, "--store-verify-key", pub,
                                   "--store-wait-ms", "30000"))
        follow.attach_buffers(snaps[0])
        os.environ.update(AWS_ACCESS_KEY_ID=WRITER[0], AWS_SECRET_ACCESS_KEY=WRITER[1])
        # A region the trainer's cluster does not reach: its own coordinator, a gateway source
        # fed by `wsync store pull --publish-to` (read-only credentials), two sinks with their
        # inference servers behind it.
        region_tmp = os.path.join(tmp, "region")
        os.makedirs(region_tmp)
        region = System(build, 2, 1, region_tmp)
        region.attach_buffers(snaps[0])
        gateway_log = open(os.path.join(tmp, "gateway.out"), "w")
        gateway = subprocess.Popen([wsync, "store", "pull", "--store", url, "--run", RUN, "--verify-key", pub,
                                    "-o", os.path.join(region_tmp, "gateway.safetensors"), "--follow", "--to",
                                    str(len(snaps)), "--poll-ms", "100", "--publish-to",
                                    f"unix:{region_tmp}/source.sock"],
                                   env=reader_env, stdout=gateway_log, stderr=subprocess.STDOUT)
        half = len(snaps) // 2
        for i, snap in enumerate(snaps[:half]):
            system.publish(snap, i + 1)
        print(f"published versions 1..{half}")
        first = os.path.join(tmp, "first.safetensors")
        out = pull(first, "--follow", "--to", str(half), "--poll-ms", "100")
        check(tensor_digest(first) == tensor_digest(snaps[half - 1]),
              f"a puller from nothing holds version {half} bit for bit ({out.strip().splitlines()[-1]})")
        # The store stops answering: the trainer's publishes do not wait for it. The mirror
        # drops the first version it cannot upload once the next waits.
        store.signal(signal.SIGSTOP)
        t0 = time.time()
        system.publish(snaps[half], half + 1)
        system.publish(snaps[half + 1], half + 2)
        check(time.time() - t0 < 10, f"two publishes while the store is stopped return in {time.time() - t0:.1f} s")
        system.wait_for(lambda: f"dropped for version {half + 2}" in system.log("source"),
                        f"the mirror to drop version {half + 1}", 60)
        store.signal(signal.SIGCONT)
        for i in range(half + 2, len(snaps)):
            system.publish(snaps[i], i + 1)
        last = len(snaps)
        print(f"published versions {half + 1}..{last}")
        out = pull(first, "--follow", "--to", str(last), "--poll-ms", "100")
        check(tensor_digest(first) == tensor_digest(snaps[-1]),
              f"the same puller follows to version {last} bit for bit")
        late = os.path.join(tmp, "late.safetensors")
        out = pull(late)
        check(tensor_digest(late) == tensor_digest(snaps[-1]),
              f"a late puller catches up to version {last}: {out.strip().splitlines()[-1]}")
        # Behind a proxy failing 40% of the ranged GETs (503, or cut short): retried, bit for bit.
        proxy = S3FaultProxy(store.s3_port, unavailable=0.2, truncated=0.2, seed=3)
        try:
            flaky = os.path.join(tmp, "flaky.safetensors")
            p = subprocess.run([wsync, "store", "pull", "--store", f"s3://weights?endpoint={proxy.endpoint()}",
                                "--run", RUN, "-o", flaky, "--range-mib", "1", "--verify-key", pub], env=reader_env, capture_output=True,
                               text=True, timeout=120)
            check(p.returncode == 0 and tensor_digest(flaky) == tensor_digest(snaps[-1]),
                  f"a puller behind a flaky proxy catches up bit for bit ({proxy.injected}){p.stderr.strip()}")
            check(proxy.injected["503"] > 0 and proxy.injected["truncated"] > 0, "the proxy injected both faults")
        finally:
            proxy.stop()
        # The region follows through its gateway: every sink at the last version, bit for bit,
        # one of them behind the other (fan-out 1: a relay).
        check(gateway.wait(timeout=120) == 0, "the region's gateway followed the run to its last version")
        last = len(snaps)
        region.wait_for(lambda: len(region.applied()) == 2 and all(v >= last for v in region.applied().values()),
                        f"version {last} on the region's sinks", 60)
        check(all(region.verify(s, snaps[-1], last) for s in region.sinks),
              f"the region's sinks hold version {last} bit for bit (parents: {region.parents()})")
        check(any(p.startswith("sink-") for p in region.parents().values()), "one region sink relays to the other")
        region.stop()
        follow.wait_for(lambda: len(follow.applied()) == 2 and all(v >= last for v in follow.applied().values()),
                        f"version {last} on the sinks of the region that reads the store", 90)
        check(all(follow.verify(s, snaps[-1], last) for s in follow.sinks),
              f"the sinks of the region that reads the store hold version {last} bit for bit "
              f"(parents: {follow.parents()})")
        logs = "".join(follow.log(s) for s in follow.sinks)
        check(len(re.findall(r"applied from the store", logs)) > 0 and len(re.findall(r"applied from sink-", logs)) > 0,
              "one of them reads the store, the other is relayed to")
        follow.stop()
        listing = subprocess.run([wsync, "store", "ls", "--store", url, "--run", RUN], env=reader_env,
                                 capture_output=True, text=True, check=True).stdout
        print(listing, end="")
        held = {int(x.split()[1].rstrip(":")): x for x in listing.splitlines() if x.startswith("version ")}
        check(all("(signed)" in x for x in held.values()), "every manifest in the store is signed")
        check(half + 1 not in held, f"version {half + 1}, dropped, is not in the store")
        check("keyframe" in held.get(half + 2, ""),
              f"version {half + 2} went up with a keyframe (nothing in the store reaches it otherwise)")
        check("patch from 3 " in held.get(6, ""), "version 6 has a merged patch from version 3 besides its own")
        check(pull(late).strip().endswith("the newest in the store"), "a puller at the newest version pulls nothing")
        try:
            pull(os.path.join(tmp, "wrong-key.safetensors"), key=other)
            check(False, "a puller with another run's key is refused")
        except RuntimeError as e:
            check("PermissionDenied" in str(e) and "signature does not verify" in str(e),
                  f"a puller with another run's key is refused: {e}")
        # The sinks that reach no source: at the last version, then two more, which the one
        # that reads the store relays to the others.
        system.wait_for(lambda: all(system.applied().get(n, 0) >= last for n in far),
                        f"version {last} on the sinks that reach no source", 90)
        for v, snap in ((last + 1, snaps[-2]), (last + 2, snaps[-1])):
            system.publish(snap, v)
            system.wait_for(lambda: all(system.applied().get(n, 0) >= v for n in far), f"version {v} on them", 90)
        check(all(system.verify(n, snaps[-1], last + 2) for n in far),
              f"the sinks that cannot reach the source hold version {last + 2} bit for bit "
              f"(parents: { {n: p for n, p in system.parents().items() if n in far} })")
        logs = "".join(system.log(n) for n in far)
        from_store = len(re.findall(r"applied from the store", logs))
        relayed = len(re.findall(r"applied from far-\d", logs))
        check(from_store > 0 and relayed > 0,
              f"they read the store ({from_store} catch-ups) and relay to each other ({relayed} versions)")
        ok = True
    finally:
        if system:
            system.stop()
        if link:
            link.close()
        if "region" in locals():
            region.stop()
        if "follow" in locals():
            follow.stop()
        if "gateway" in locals() and gateway.poll() is None:
            gateway.kill()
        store.stop()
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"logs: {tmp}")
    print("store: ok")


if __name__ == "__main__":
    main()
