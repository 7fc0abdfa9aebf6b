#!/usr/bin/python3
"""Faults against the real system on loopback (real processes, real gRPC,
UCX over tcp): a late sink gets a keyframe; a sink killed with SIGKILL and
restarted catches up with one merged patch; a source restart and a
coordinator restart lose nothing and versions keep growing; injected chunk
corruption is detected and re-fetched; a sink lagging beyond max_staleness
is evicted to a keyframe (evict policy) or holds the trainer back (block);
a trainer that returns after the source's copy (publish --after-copy)
publishes back to back and every sink ends bit-exact, a failed background
publish included.

    system_faults_test.py BUILD DATA_DIR
"""
import base64
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
from system_demo import System, gpu_present  # noqa: E402


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print(f"  ok: {what}")


# Each scenario's directory (its logs): removed once every scenario passed.
SCENARIO_DIRS = []


def scenario(name, build, fanout=2, sinks=2, coordinator_args=(), source_args=(), token=None):
    tmp = tempfile.mkdtemp(prefix=f"wsync_{name}_")
    SCENARIO_DIRS.append(tmp)
    print(f"== {name}")
    # WSYNC_TEST_DEVICE=N: the weights live in GPU N's memory (CUDA IPC).
    device = int(os.environ.get("WSYNC_TEST_DEVICE", "-1"))
    return System(build, sinks, fanout, tmp, coordinator_args, source_args, device=device, token=token)


def synced(system, version, names=None):
    names = names or system.sinks
    system.wait_for(lambda: all(system.applied().get(s, 0) >= version for s in names),
                    f"version {version} on {names}", 60)


def late_join_and_sigkill(build, snaps):
    system = scenario("late-join-and-sigkill", build, fanout=4, sinks=2)
    try:
        system.attach_buffers(snaps[0])
        for v in range(1, 4):
            system.publish(snaps[v - 1], v)
        synced(system, 3)
        # A sink that joins late starts from a keyframe.
        system.start_sink("late")
        system.attach_buffers(snaps[0], ["late"])
        synced(system, 3, ["late"])
        check(system.verify("late", snaps[2], 3), "late sink is bit-exact at version 3")
        check("keyframe 0->3" in system.log("late"), "late sink received a keyframe")
        # sink-1 is killed; versions 4 and 5 go by; it restarts and catches up
        # with one merged patch 3->5 into the memory its server kept.
        system.kill("sink-1", signal.SIGKILL)
        system.publish(snaps[3], 4)
        system.publish(snaps[4], 5)
        synced(system, 5, ["sink-0", "late"])
        system.restart("sink-1")
        synced(system, 5, ["sink-1"])
        check(system.verify("sink-1", snaps[4], 5), "restarted sink is bit-exact at version 5")
        check(re.search(r"patch 3->5", system.log("sink-1")) is not None, "it caught up with one merged patch 3->5")
    finally:
        system.stop()


def restarts(build, snaps):
    system = scenario("restarts", build)
    try:
        system.attach_buffers(snaps[0])
        system.publish(snaps[0], 1)
        system.publish(snaps[1], 2)
        synced(system, 2)
        # The source restarts: versions keep growing, sinks resume.
        system.restart("source")
        system.wait_for(lambda: os.path.exists(f"{system.tmp}/source.sock"), "source's local API")
        time.sleep(0.5)
        try:
            system.publish(snaps[1], 2)
            check(False, "republishing version 2 after a restart is refused")
        except RuntimeError as e:
            check("not above the head" in str(e), "republishing version 2 after a restart is refused")
        system.publish(snaps[2], 3)
        synced(system, 3)
        check(all(system.verify(s, snaps[2], 3) for s in system.sinks), "sinks bit-exact after a source restart")
        # The coordinator is killed and restarted from its store: nothing lost.
        before = system.status()
        system.kill("coordinator", signal.SIGKILL)
        system.restart("coordinator")
        system.wait_for(lambda: system.status() is not None, "coordinator back")
        after = system.status()
        check(after["headVersion"] == before["headVersion"] == "3", "head version survives the coordinator")
        check(sorted(n["name"] for n in after["nodes"]) == sorted(n["name"] for n in before["nodes"]),
              "registrations survive the coordinator")
        system.publish(snaps[3], 4)
        synced(system, 4)
        check(all(system.verify(s, snaps[3], 4) for s in system.sinks), "sinks bit-exact after a coordinator restart")
    finally:
        system.stop()


def corruption(build, snaps):
    system = scenario("corruption", build, source_args=["--inject-corrupt-every", "2"])
    try:
        system.attach_buffers(snaps[0])
        for v in range(1, 4):
            system.publish(snaps[v - 1], v)
        synced(system, 3)
        check(all(system.verify(s, snaps[2], 3) for s in system.sinks), "bit-exact despite corrupted chunks")
        logs = "".join(system.log(s) for s in system.sinks)
        check("arrived corrupt: fetching it again" in logs, "corrupted chunks were detected and re-fetched")
    finally:
        system.stop()


def freeze_one_sink(system, snaps):
    """Both sinks at version 1, then sink-1 frozen (SIGSTOP) while version 2 goes out."""
    system.attach_buffers(snaps[0])
    system.publish(snaps[0], 1)
    synced(system, 1)
    system.kill("sink-1", signal.SIGSTOP)
    system.publish(snaps[1], 2)


def staleness(build, snaps):
    # Evict: a frozen sink lags beyond the bound; the trainer goes on; the
    # sink resyncs from a keyframe when it wakes.
    system = scenario("staleness-evict", build, coordinator_args=["--max-staleness", "1",
                                                                  "--staleness-policy", "evict",
                                                                  "--node-ttl-ms", "30000"])
    try:
        freeze_one_sink(system, snaps)
        synced(system, 2, ["sink-0"])
        system.publish(snaps[2], 3)  # sink-1 would lag by 2 > 1: evicted
        st = {n["name"]: n for n in system.status()["nodes"]}
        check(st["sink-1"].get("resyncKeyframe") is True, "the lagging sink is told to resync from a keyframe")
        system.kill("sink-1", signal.SIGCONT)
        synced(system, 3)
        check(system.verify("sink-1", snaps[2], 3), "the evicted sink is bit-exact after its keyframe")
    finally:
        system.stop()
    # Block: the trainer is held back while a sink lags.
    system = scenario("staleness-block", build, coordinator_args=["--max-staleness", "1",
                                                                  "--staleness-policy", "block"])
    try:
        freeze_one_sink(system, snaps)
        try:
            system.publish(snaps[2], 3)
            check(False, "publishing past the bound is held back")
        except RuntimeError as e:
            check("sink-1" in str(e) and "staleness" in str(e), "publishing past the bound is held back, naming sink-1")
        system.kill("sink-1", signal.SIGCONT)
        system.publish(snaps[2], 3, wait_ms=20000)  # waits until sink-1 catches up
        synced(system, 3)
        check(system.verify("sink-1", snaps[2], 3), "after waiting, every sink is bit-exact")
    finally:
        system.stop()


def publish_after_copy(build, snaps):
    # The trainer goes on as soon as its weights are copied: versions
    # published back to back that way reach every sink bit-exactly; a version
    # that is not above the head is refused at once; a version whose
    # background publish fails (injected: its announce to the coordinator)
    # is reported by the next publish, and the one after recovers.
    last = len(snaps)
    system = scenario("publish-after-copy", build, source_args=["--inject-fail-announce", str(last - 2)])
    try:
        system.attach_buffers(snaps[0])
        for v in range(1, last - 2):
            system.publish(snaps[v - 1], v, after_copy=True)
        if system.device_args:
            # Device regions publish before returning: the failure comes at once.
            try:
                system.publish(snaps[last - 3], last - 2, after_copy=True)
                check(False, "the failed publish is reported")
            except RuntimeError as e:
                check("injected failure" in str(e), "the failed publish is reported at once (device region)")
        else:
            system.publish(snaps[last - 3], last - 2, after_copy=True)  # copied; its announce fails behind
            try:
                system.publish(snaps[last - 2], last - 1, after_copy=True)
                check(False, "the failed background publish is reported")
            except RuntimeError as e:
                check(f"version {last - 2}, copied and published in the background" in str(e),
                      "the next publish reports the failed background publish, naming its version")
        system.publish(snaps[last - 2], last - 1, after_copy=True)
        system.publish(snaps[last - 1], last, after_copy=True)
        synced(system, last)
        check(all(system.verify(s, snaps[-1], last) for s in system.sinks), "every sink bit-exact at the last version")
        try:
            system.publish(snaps[0], last, after_copy=True)
            check(False, "a version not above the head is refused")
        except RuntimeError as e:
            check("not above the head" in str(e), "a version not above the head is refused at once")
    finally:
        system.stop()


def hostile_peers(build, snaps):
    # The daemons hold the cluster token (data-plane security auth, the
    # default with a token). Peers without it, with a wrong one, and one with
    # it flooding PULLs hit the source and a relay while versions are
    # published: each is refused, and every sink stays bit-exact.
    system = scenario("hostile-peers", build, fanout=1, sinks=2, token="hostile-test-token")
    attacker = os.path.join(build, "tests", "exchange_attacker")
    try:
        system.attach_buffers(snaps[0])
        system.publish(snaps[0], 1)
        synced(system, 1)
        nodes = {n["name"]: n for n in (system.status() or {}).get("nodes", [])}
        relay = next(s for s, p in system.parents().items() if p == "source")
        for target in ("source", relay):
            address = base64.b64decode(nodes[target]["dataAddress"]).decode()  # bytes in the JSON
            for mode in (["unauthenticated"], ["oversized"], ["wrong-token"], ["flood", "hostile-test-token", "500"]):
                r = subprocess.run([attacker, address, *mode], env=system.env, capture_output=True, text=True,
                                   timeout=60)
                said = (r.stdout.strip().splitlines() or [r.stderr.strip()[-200:]])[-1]  # its verdict, after any log
                check(r.returncode == 0, f"{target}: {said}")
        for v in range(2, 5):
            system.publish(snaps[v - 1], v)
        synced(system, 4)
        check(all(system.verify(s, snaps[3], 4) for s in system.sinks),
              "every sink bit-exact at version 4, the relay's child included")
        log = system.log("source")
        check("refusing peer" in log and "pulls refused so far" in log,
              "the source logged the refused peers and the refused pulls")
    finally:
        system.stop()


def main():
    build, data = sys.argv[1], sys.argv[2]
    if int(os.environ.get("WSYNC_TEST_DEVICE", "-1")) >= 0 and not gpu_present():
        print("SKIP: no GPU (nvidia-smi finds none)")
        return
    snaps = sorted(glob.glob(os.path.join(data, "*.safetensors")))
    if len(snaps) < 5:
        print(f"SKIP: fewer than 5 snapshots in {data}")
        return
    for test in (late_join_and_sigkill, restarts, corruption, staleness, publish_after_copy, hostile_peers):
        test(build, snaps)
    for d in SCENARIO_DIRS:
        shutil.rmtree(d, ignore_errors=True)
    print("PASS")


if __name__ == "__main__":
    main()
