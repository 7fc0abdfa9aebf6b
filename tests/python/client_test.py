#!/usr/bin/python3
"""The Python client (`import wsync`) against the real system on loopback: a
coordinator, a source and sinks (real processes, gRPC, UCX over tcp), a
trainer and inference servers in their own processes using the client.

    client_test.py BUILD [SCENARIO ...]

Scenarios:
  train_lr1e-6, train_lr1e-5  real AdamW training, 8 steps, FP32 masters;
                              two inference processes (one with every tensor
                              in its own shared memory segment) verify every
                              version bit for bit; a restarted trainer gets
                              the next valid version
  sigkill_holder              an inference process SIGKILLed while it holds,
                              another SIGSTOPped while it holds (its hold
                              lapses by TTL): the trainer keeps publishing
                              within the TTL, the other sink keeps syncing
  mismatch                    a model of other shapes: a clear error at once
                              (registered before and after the layout exists);
                              the source serves it a bounded number of pulls
                              over a minute (WSYNC_MISMATCH_SECONDS)
  persistent_failure          a source whose every chunk arrives corrupt: the
                              sink reports why, backs off, and its pulls stay
                              within the documented bound
  reregister                  a sink's tensors registered again (other memory)
                              and unregistered; a source's too
  daemon_restart              the source and then the sink SIGKILLed and
                              restarted under a running trainer and inference
                              server: the client registers the same memory
                              again, the sink resumes from the version its
                              buffers hold (a patch, not a keyframe)
  unconfirmed_publish         a version whose announce fails (injected): the
                              client retries it (bounded), the trainer steps
                              on; the same version number with the new weights
                              is refused (StaleVersionError), never published
                              with the old content; the next one reaches the
                              sink bit-exact (found by the fault campaign)
  sigterm                     SIGTERM stops, each within a second: an idle
                              sink, a sink whose inference server holds, a
                              source, the coordinator
  resized_fleet               TP 2 ranks, then the trainer serves TP 2 and 4 and TP 4 ranks join
  tensor_parallel             inference ranks of TP 2 and TP 4 laid out as vLLM
                              lays them (fused qkv and gate_up, shards,
                              replicated kv heads, padded vocabulary), each
                              with its own sink, under a real trainer that
                              serves their layouts: after every version the
                              canonical tensors gathered from each degree's
                              ranks equal the trainer's BF16 weights bit for
                              bit; a sink of a layout the source does not
                              serve registers and says it waits to be served
  offered_layouts             the trainer serves the layouts sinks offered:
                              TP 2 ranks, then TP 4 ranks join mid-run and are
                              served from the next version, the trainer
                              registering nothing again
  two_sources                 a trainer whose tensors two sources publish, half
                              each (part 0 and 1 of 2): two inference
                              processes hold the trainer's weights bit for bit
                              after every version; one source SIGKILLed after
                              the other published its part of a version: the
                              version stays partial (wsync versions says so)
                              and no sink applies it; restarted, the source
                              publishes its part and the version and the next
                              ones arrive whole
  gpu                         CUDA tensors in separate allocations (IPC, no
                              relocation); skipped without a GPU and CUDA torch
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))
from system_demo import System  # noqa: E402

WORKERS = os.path.join(HERE, "client_workers.py")
# The trainers and inference servers run with this test's Python: Debian's
# (torch 1.13) or the vLLM environment's (torch 2.x).
PY = sys.executable


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print(f"  ok: {what}", flush=True)


class Worker:
    """A client_workers.py process whose JSON lines are read as events."""

    def __init__(self, system, name, *args):
        self.name = name
        self.log_path = os.path.join(system.tmp, name + ".out")
        env = dict(system.env, PYTHONPATH=os.pathsep.join(
            [os.path.join(system.build, "python"), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([PY, WORKERS, *args], env=env,
                                     stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT)
        system.procs["worker-" + name] = (None, self.proc)  # stopped with the system

    def events(self):
        out = []
        for line in open(self.log_path):
            if line.startswith("{"):
                out.append(json.loads(line))
        return out

    def event(self, kind):
        return [e for e in self.events() if e["event"] == kind]

    def wait_event(self, kind, timeout=120):
        end = time.time() + timeout
        while time.time() < end:
            if self.event(kind):
                return self.event(kind)
            if self.proc.poll() is not None and not self.event(kind):
                break
            time.sleep(0.05)
        raise AssertionError(f"{self.name}: no '{kind}' event; output:\n{open(self.log_path).read()[-3000:]}")

    def finish(self, timeout=180):
        rc = self.proc.wait(timeout=timeout)
        if rc != 0:
            raise AssertionError(f"{self.name} exited {rc}:\n{open(self.log_path).read()[-3000:]}")


def run_client(s, build, code, *args):
    """Runs `code` with the built `wsync` package, given the source's and sink-0's local addresses (and args)."""
    return subprocess.run([PY, "-c", code, local(s, "source"), local(s, "sink-0"), *args],
                          env=dict(s.env, PYTHONPATH=os.path.join(build, "python")), capture_output=True, text=True,
                          cwd=os.path.join(HERE, "..", ".."), timeout=300)


def wait_then_check(s, pred, what, timeout=60):
    """Waits up to `timeout` s for `pred` (an event, not a time), leaving the
    verdict to the check that follows, which names what was seen."""
    try:
        s.wait_for(pred, what, timeout)
    except RuntimeError:
        pass


# Each scenario's directory (its logs): removed once every scenario passed.
SCENARIO_DIRS = []


def system(build, name, sinks=2, coordinator_args=(), sink_args=(), source_args=()):
    tmp = tempfile.mkdtemp(prefix=f"wsync_client_{name}_")
    SCENARIO_DIRS.append(tmp)
    print(f"== {name}", flush=True)
    s = System(build, sinks, 4, tmp, coordinator_args, source_args, sink_args=sink_args)
    s.build = build
    for n in s.sinks:
        s.wait_for(lambda: os.path.exists(f"{tmp}/{n}.sock"), f"{n}'s local API")
    s.wait_for(lambda: os.path.exists(f"{tmp}/source.sock"), "the source's local API")
    return s


def local(s, name):
    return f"unix:{s.tmp}/{name}.sock"


def train(build, lr):
    # Segments of 0.25 MiB: the model's versions (1 MB in BF16) are streamed
    # to the sinks in segments as they are encoded (docs/data-plane.md).
    s = system(build, f"train_lr{lr}", source_args=("--segment-mib", "0.25"))
    try:
        a = Worker(s, "inference-a", "inference", local(s, "sink-0"), s.tmp, "a", "--until", "8", "--seed", "1")
        b = Worker(s, "inference-b", "inference", local(s, "sink-1"), s.tmp, "b", "--until", "8", "--seed", "2",
                   "--no-pack")
        a.wait_event("registered")
        b.wait_event("registered")
        t = Worker(s, "trainer", "trainer", local(s, "source"), s.tmp, "--steps", "8", "--lr", lr, "--lockstep", "2")
        t.finish()
        a.finish()
        b.finish()
        reg = t.event("registered")[0]
        check(reg["cast"] == reg["tensors"], f"all {reg['tensors']} FP32 master tensors are published as BF16")
        pub = t.event("published")
        check([p["version"] for p in pub] == list(range(1, 9)), "the trainer published versions 1..8, one per step")
        ratios = [round(p["ratio"], 1) for p in pub[1:]]
        print(f"  patch ratios of versions 2..8 (lr {lr}): {ratios}")
        for w in (a, b):
            ver = w.event("verified")
            check([v["version"] for v in ver] == list(range(1, 9)) and all(not v["mismatched"] for v in ver),
                  f"{w.name} held the trainer's BF16 weights bit for bit after every version 1..8")
        # A restarted trainer continues from the coordinator's head.
        r = Worker(s, "trainer-2", "trainer", local(s, "source"), s.tmp, "--steps", "1", "--lr", lr)
        r.finish()
        check(r.event("registered")[0]["next"] == 9, "a restarted trainer is told the next valid version (9)")
        check(r.event("published")[0]["version"] == 9, "and publishes it")
        code = ("import wsync, torch\n"
                f"src = wsync.Source('{local(s, 'source')}')\n"
                "src.register({'model.embed_tokens.weight': torch.zeros(512, 128)})\n")
        p = subprocess.run([PY, "-c", code], env=dict(s.env, PYTHONPATH=os.path.join(build, "python")),
                           capture_output=True, text=True)
        check(p.returncode != 0 and "FailedPreconditionError" in p.stderr and "lm_head.weight" in p.stderr,
              "a trainer registering another layout is refused, naming a tensor: " + p.stderr.strip().splitlines()[-1])
        code = ("import wsync, torch, sys\n"
                f"src = wsync.Source('{local(s, 'source')}')\n"
                "sys.path.insert(0, 'examples')\n"
                "from tiny_llama import LlamaForCausalLM\n"
                "src.register(LlamaForCausalLM())\n"
                "try:\n    src.publish(5)\nexcept wsync.StaleVersionError as e:\n"
                "    print(e.next_version, e.reason, e.metadata['head_version'])\n")
        p = subprocess.run([PY, "-c", code], capture_output=True, text=True,
                           env=dict(s.env, PYTHONPATH=os.path.join(build, "python")),
                           cwd=os.path.join(HERE, "..", ".."))
        check(p.stdout.strip() == "10 STALE_VERSION 9", "publish(5) after version 9 raises StaleVersionError "
                                                        f"(next_version=10, reason STALE_VERSION, head 9): "
                                        f"{p.stdout.strip()} {p.stderr.strip()[-300:]}")
    finally:
        s.stop()


def wsync_status(s, name):
    import wsync
    snk = wsync.Sink(local(s, name))
    try:
        return snk.status()
    finally:
        snk.close()


def ranks_differ(s, tp, v):
    """The canonical tensors whose slices held by TP `tp`'s ranks at version
    `v` (DIR/tpT-rankR.vV.pt), gathered back, differ from the trainer's BF16
    weights (DIR/expect-vV.pt) in any bit."""
    import torch
    from wsync import layouts
    from client_workers import tiny_config
    cfg = tiny_config()
    shapes = layouts.canonical_shapes(cfg)
    expect = torch.load(os.path.join(s.tmp, f"expect-v{v}.pt"))
    held = [(layouts.tp_layout(cfg, tp, r), torch.load(os.path.join(s.tmp, f"tp{tp}-rank{r}.v{v}.pt")))
            for r in range(tp)]
    back = layouts.gather(held, shapes)
    return [k for k in shapes if not torch.equal(back[k].view(torch.int16), expect[k].view(torch.int16))]


EARLY, LATE = [(2, r) for r in range(2)], [(4, r) for r in range(4)]  # TP 2 ranks, then TP 4 ranks joining


def fleet(build, name, versions):
    """A system with TP 2 ranks and a whole-model sink registered, and sinks
    for TP 4 ranks to join: (system, a function starting the rank of sink i,
    the running workers)."""
    sys.path.insert(0, os.path.join(build, "python"))
    sys.path.insert(0, HERE)
    s = system(build, name, sinks=len(EARLY) + len(LATE) + 1)

    def rank(i, tp, r):
        return Worker(s, f"tp{tp}-rank{r}", "tp_inference", local(s, f"sink-{i}"), s.tmp, f"tp{tp}-rank{r}",
                      "--tp", str(tp), "--rank", str(r), "--until", str(versions), "--seed", str(10 + i))
    try:
        workers = [rank(i, tp, r) for i, (tp, r) in enumerate(EARLY)]
        workers.append(Worker(s, "whole", "inference", local(s, f"sink-{len(EARLY)}"), s.tmp, "whole", "--until",
                              str(versions), "--seed", "3"))
        for w in workers:
            w.wait_event("registered")
    except BaseException:
        s.stop()
        raise
    return s, rank, workers


def join_fleet(rank):
    """The TP 4 ranks, registered."""
    joined = [rank(len(EARLY) + 1 + i, tp, r) for i, (tp, r) in enumerate(LATE)]
    for w in joined:
        w.wait_event("registered")
    return joined


def check_fleet(s, workers, joined, versions, joined_at, how):
    """Every worker done; the whole sink and every rank of both degrees held
    the trainer's BF16 weights bit for bit (TP 4 from version joined_at)."""
    for w in workers + joined:
        w.finish()
    ver = workers[-1].event("verified")
    check([v["version"] for v in ver] == list(range(1, versions + 1)) and all(not v["mismatched"] for v in ver),
          f"the whole-model sink held the trainer's BF16 weights bit for bit {how}")
    for tp, first in ((2, 1), (4, joined_at)):
        for v in range(first, versions + 1):
            bad = ranks_differ(s, tp, v)
            check(not bad, f"version {v}, TP {tp}: the ranks' slices equal the trainer's BF16 weights {bad[:3]}")


def resized_fleet(build):
    """TP 2 ranks and a whole sink from version 1; after version 3 the trainer
    serves TP 2 and TP 4 (registering again with both), TP 4 ranks join, a
    TP 2 rank's sink daemon is SIGKILLed and restarted, and every rank holds
    its slices of versions up to 6 bit for bit."""
    versions, resize = 6, 3
    s, rank, workers = fleet(build, "resized_fleet", versions)
    try:
        t = Worker(s, "trainer", "trainer", local(s, "source"), s.tmp, "--steps", str(versions), "--lr", "1e-5",
                   "--lockstep", str(len(workers)), "--serve-tp", "2", "--resize-at", str(resize),
                   "--resize-tp", "2,4", "--resize-lockstep", str(len(workers) + len(LATE)))
        t.wait_event("resized")
        status = subprocess.run([s.wsync, "status"], env=s.env, capture_output=True, text=True).stdout
        check("cut in tile grids for the layouts served" in status,
              "`wsync status` shows the layout and its tile grids: " + status.splitlines()[1])
        # Meanwhile TP 2 rank 0's sink daemon restarts while the rank waits in
        # RankSync.sync(): the rank rides it out and registers its pieces again.
        s.kill("sink-0", signal.SIGKILL)
        s.restart("sink-0")
        joined = join_fleet(rank)
        open(os.path.join(s.tmp, "go"), "w").close()
        t.finish()
        check_fleet(s, workers, joined, versions, resize, "across the change of layouts")
    finally:
        s.stop()


def offered_layouts(build):
    """The trainer names no layout: it serves those the sinks offered
    (serve_offered). TP 2 ranks and a whole sink from version 1; after
    version 3, TP 4 ranks register (their layout is not served yet: they
    wait), and from version 4 on the source codes for them too, with no
    registration of the trainer again; every rank holds its slices bit for
    bit."""
    versions, join = 6, 3
    s, rank, workers = fleet(build, "offered_layouts", versions)
    try:
        t = Worker(s, "trainer", "trainer", local(s, "source"), s.tmp, "--steps", str(versions), "--lr", "1e-5",
                   "--lockstep", str(len(workers)), "--serve-offered", "--pause-after", str(join),
                   "--lockstep-after-pause", str(len(workers) + len(LATE)))
        t.wait_event("paused")
        joined = join_fleet(rank)
        # The sink says why from its registration on; waited for, not sampled
        # once (a loaded machine), and named if it never says it.
        said = []

        def says_why():
            said.append(wsync_status(s, f"sink-{len(EARLY) + 1}").sync_error)
            return "tile grid" in said[-1]
        wait_then_check(s, says_why, "the TP 4 rank's sink to say it waits for its layout")
        check("tile grid" in said[-1],
              f"a TP 4 rank registered before its layout is served waits, saying why: {said[-1]}")
        open(os.path.join(s.tmp, "resume"), "w").close()
        t.finish()
        check_fleet(s, workers, joined, versions, join + 1, "across the new layouts")
    finally:
        s.stop()


def tensor_parallel(build):
    sys.path.insert(0, os.path.join(build, "python"))
    sys.path.insert(0, HERE)
    ranks = [(2, r) for r in range(2)] + [(4, r) for r in range(4)]
    versions = 6
    s = system(build, "tensor_parallel", sinks=len(ranks) + 1)
    try:
        workers = [Worker(s, f"tp{tp}-rank{r}", "tp_inference", local(s, f"sink-{i}"), s.tmp, f"tp{tp}-rank{r}",
                          "--tp", str(tp), "--rank", str(r), "--until", str(versions), "--seed", str(10 + i))
                   for i, (tp, r) in enumerate(ranks)]
        # And a sink holding the whole model, as before: it verifies every version itself.
        workers.append(Worker(s, "whole", "inference", local(s, f"sink-{len(ranks)}"), s.tmp, "whole", "--until",
                              str(versions), "--seed", "3"))
        for w in workers:
            w.wait_event("registered")
        t = Worker(s, "trainer", "trainer", local(s, "source"), s.tmp, "--steps", str(versions), "--lr", "1e-5",
                   "--lockstep", str(len(ranks) + 1), "--serve-tp", "2,4", "--pause-after", "3")
        # The source daemon is SIGKILLed once every sink holds version 3 (a
        # restarted source holds no earlier version: the trainer's lockstep
        # would wait for sinks that cannot get it) and restarted: the
        # trainer's client registers its memory (and the layouts served)
        # again, and the ranks get the restarted source's keyframe selections.
        t.wait_event("paused")
        s.kill("source", signal.SIGKILL)
        s.restart("source")
        open(os.path.join(s.tmp, "resume"), "w").close()
        t.finish()
        check([e["version"] for e in t.event("published")] == list(range(1, versions + 1)),
              "the trainer published versions 1..6 across the source's restart")
        for w in workers:
            w.finish()
        ver = workers[-1].event("verified")
        check([v["version"] for v in ver] == list(range(1, versions + 1)) and all(not v["mismatched"] for v in ver),
              "a whole-model sink beside them holds the trainer's BF16 weights bit for bit after every version")
        for v in range(1, versions + 1):
            for tp in (2, 4):
                bad = ranks_differ(s, tp, v)
                check(not bad, f"version {v}, TP {tp}: the canonical tensors gathered from the {tp} ranks equal "
                               f"the trainer's BF16 weights bit for bit {bad[:3]}")
        # Each rank pulls its selection only: bytes received against what the
        # trainer published (keyframe and patches, whole).
        whole = sum(p["bytes"] for p in t.event("published"))
        for i, (tp, r) in enumerate(ranks):
            got = wsync_status(s, f"sink-{i}").bytes_received
            print(f"  TP {tp} rank {r}: {got} bytes received, {got / whole:.3f} of the {whole} published")
            check(0 < got < whole * (0.7 if tp == 2 else 0.45),
                  f"TP {tp} rank {r} received its selection, not the whole ({got} of {whole} bytes)")
        # A layout no served grid holds: q_proj rows cut at 10. Registered (its
        # layout offered), it waits for a source to serve it, saying so.
        code = ("import sys, torch, wsync\n"
                "from wsync.layouts import Piece, RuntimeTensor\n"
                "snk = wsync.Sink(sys.argv[2])\n"
                "lay = [RuntimeTensor('q', (10, 128), (Piece('model.layers.0.self_attn.q_proj.weight', (0, 0), "
                "(10, 128), (0, 0)),))]\n"
                "snk.register({'q': torch.zeros(10, 128, dtype=torch.bfloat16)}, layout=lay)\n"
                "print('registered;', snk.status().sync_error)\n")
        p = run_client(s, build, code)
        check("registered;" in p.stdout and "q_proj" in p.stdout and "tile grid" in p.stdout,
              "a sink whose pieces the source's grid does not hold registers and says it waits to be served: "
              + (p.stdout + p.stderr).strip()[-300:])
    finally:
        s.stop()


def two_sources(build):
    versions, pause = 6, 4
    s = system(build, "two_sources", sinks=2)
    try:
        s.spawn("source-b", [s.wsyncd, "source", "--name", "source-b", "--local", f"unix:{s.tmp}/source-b.sock",
                             "--node-ttl-ms", "3000"])
        s.wait_for(lambda: os.path.exists(f"{s.tmp}/source-b.sock"), "source-b's local API")
        inference = [Worker(s, f"inference-{n}", "inference", local(s, f"sink-{i}"), s.tmp, n, "--until",
                            str(versions), "--seed", str(i + 1)) for i, n in enumerate("ab")]
        for w in inference:
            w.wait_event("registered")
        t = Worker(s, "trainer", "split_trainer", local(s, "source"), s.tmp, "--steps", str(versions), "--lr", "1e-5",
                   "--lockstep", "2", "--local-b", local(s, "source-b"), "--pause-at", str(pause))
        t.wait_event("paused")
        s.kill("source-b")  # SIGKILL between the two parts of version `pause`
        # Every sink's report of version pause - 1 reaches the coordinator
        # (the workers saw it applied locally first), then nothing moves on.
        wait_then_check(s, lambda: all(s.applied().get(n) == pause - 1 for n in s.sinks),
                        f"the coordinator to know every sink holds {pause - 1}")
        time.sleep(1.5)
        applied = s.applied()
        check(all(applied.get(n) == pause - 1 for n in s.sinks),
              f"with one part of version {pause} published and its other source killed, every sink stays at "
              f"{pause - 1}: {applied}")
        out = subprocess.run([s.wsync, "versions"], env=s.env, capture_output=True, text=True).stdout
        check(f"version {pause}: partial, 1 of 2 parts" in out, "`wsync versions` shows the partial version: " +
              next((line for line in out.splitlines() if "partial" in line), out[-200:]))
        s.restart("source-b")
        open(os.path.join(s.tmp, "resume"), "w").close()
        t.finish()
        for w in inference:
            w.finish()
            ver = w.event("verified")
            check([v["version"] for v in ver] == list(range(1, versions + 1)) and all(not v["mismatched"] for v in ver),
                  f"{w.name} held the trainer's BF16 weights bit for bit after every version 1..{versions} "
                  "(each published by two sources)")
    finally:
        s.stop()


def sigkill_holder(build):
    ttl_s = 3
    s = system(build, "sigkill_holder", sinks=3, coordinator_args=["--max-staleness", "1", "--staleness-policy", "block"],
               sink_args=["--hold-ttl-ms", str(ttl_s * 1000)])
    try:
        killed = Worker(s, "killed", "inference", local(s, "sink-0"), s.tmp, "k", "--until", "100", "--hold-forever")
        stopped = Worker(s, "stopped", "inference", local(s, "sink-1"), s.tmp, "s", "--until", "100", "--hold-forever",
                         "--hold-ttl", str(ttl_s))
        other = Worker(s, "other", "inference", local(s, "sink-2"), s.tmp, "o", "--until", "6")
        for w in (killed, stopped, other):
            w.wait_event("registered")
        t = Worker(s, "trainer", "trainer", local(s, "source"), s.tmp, "--steps", "6", "--lr", "1e-5",
                   "--wait", "30")
        killed.wait_event("holding")
        stopped.wait_event("holding")
        s.wait_for(lambda: {"sink-0", "sink-1"} <= lease_nodes(s), "the holds as coordinator leases", 10)
        check(True, "the active holds appear in `wsync leases`")
        killed.proc.send_signal(signal.SIGKILL)
        stopped.proc.send_signal(signal.SIGSTOP)
        killed.proc.wait()
        left = [n for n in os.listdir("/dev/shm") if f"-{killed.proc.pid}-" in n]
        check(not left, f"the SIGKILLed client left nothing in /dev/shm (its memory has no name): {left}")
        t0 = time.time()
        t.finish()
        other.finish()
        waits = [p["wait_s"] for p in t.event("published")]
        print(f"  trainer's wait per publish (s): {[round(w, 2) for w in waits]}")
        check(len(waits) == 6, "the trainer published all 6 versions")
        check(max(waits) < ttl_s + 3, f"no publish waited longer than the hold TTL ({ttl_s} s) plus 3 s")
        check([v["version"] for v in other.event("verified")][-1] == 6, "the other sink kept syncing, bit-exact, to 6")
        check(time.time() - t0 < 60, "the whole run took under a minute")
        s.wait_for(lambda: s.applied().get("sink-0", 0) >= 6 and s.applied().get("sink-1", 0) >= 6,
                   "the holders' sinks apply once their holds end", 30)
        check(True, "the SIGKILLed and the SIGSTOPped holders' sinks reached version 6 (their holds ended)")
        stopped.proc.send_signal(signal.SIGKILL)
    finally:
        s.stop()


def lease_nodes(s):
    out = subprocess.run([s.wsync, "leases", "--json"], env=s.env, capture_output=True, text=True).stdout
    return {lease["node"] for lease in json.loads(out or "{}").get("leases", [])}


def mismatch(build):
    seconds = float(os.environ.get("WSYNC_MISMATCH_SECONDS", "60"))
    s = system(build, "mismatch", sinks=2)
    try:
        # Registered before any layout exists: refused once the trainer publishes.
        early = Worker(s, "early", "mismatched", local(s, "sink-1"), "--linger", str(seconds))
        early.wait_event("registered")
        good = Worker(s, "good", "inference", local(s, "sink-0"), s.tmp, "g", "--until", "2")
        good.wait_event("registered")
        t = Worker(s, "trainer", "trainer", local(s, "source"), s.tmp, "--steps", "2", "--lr", "1e-5")
        t.finish()
        good.finish()
        err = early.wait_event("error", timeout=30)[0]
        check(err["code"] == "FAILED_PRECONDITION" and "tensor 'model." in err["error"],
              f"a sink registered before the layout existed: wait() fails in {err['seconds']:.1f} s: {err['error']}")
        # Registered after: refused at registration, naming the tensor.
        late = Worker(s, "late", "mismatched", local(s, "sink-1"))
        late_err = late.wait_event("error", timeout=30)[0]
        check(late_err["code"] == "FAILED_PRECONDITION" and late_err["seconds"] < 5 and "shape" in late_err["error"],
              f"a mismatched model is refused at registration in {late_err['seconds']:.2f} s: {late_err['error']}")
        st = subprocess.run([s.wsync, "local-status", "--local", local(s, "sink-1")], env=s.env,
                            capture_output=True, text=True).stdout
        pulls0 = pulls(s, "sink-1")
        time.sleep(seconds)
        pulls1 = pulls(s, "sink-1")
        check(pulls1 - pulls0 <= 2 and pulls1 <= 4,
              f"the mismatched sink made {pulls1} pulls in all, {pulls1 - pulls0} over {seconds:.0f} s (bound: 2)")
        status = subprocess.run([s.wsync, "status"], env=s.env, capture_output=True, text=True).stdout
        check("sink-1" in status and "tensor" in status, "`wsync status` shows why sink-1 cannot sync")
        del st
    finally:
        s.stop()


def pulls(s, sink):
    out = subprocess.run([s.wsync, "local-status", "--local", local(s, sink), "--json"], env=s.env,
                         capture_output=True, text=True).stdout
    return int(json.loads(out).get("pullsMade", 0))


def persistent_failure(build):
    seconds = 30
    s = system(build, "persistent_failure", sinks=1, source_args=["--inject-corrupt-every", "1"])
    try:
        sink = Worker(s, "inference", "inference", local(s, "sink-0"), s.tmp, "i", "--until", "1")
        sink.wait_event("registered")
        t = Worker(s, "trainer", "trainer", local(s, "source"), s.tmp, "--steps", "1", "--lr", "1e-5")
        t.finish()
        t0 = time.time()
        time.sleep(seconds)
        made = pulls(s, "sink-0")
        st = json.loads(subprocess.run([s.wsync, "local-status", "--local", local(s, "sink-0"), "--json"], env=s.env,
                                       capture_output=True, text=True).stdout)
        # docs/local-api.md: at most 2 pulls per attempt; attempts at 0, 0.1, 0.3, 0.7, 1.5, 3.1, 6.3, 12.7,
        # 25.5 s at the shortest backoff draws: at most 9 attempts in the first 30 s.
        check(0 < made <= 18, f"{made} pulls in {time.time() - t0:.0f} s under persistent corruption (bound: 18)")
        check("corrupt" in st.get("syncError", ""), f"the sink says why: {st.get('syncError', '')[:160]}")
        check(int(st.get("syncFailures", 0)) >= 3, f"{st.get('syncFailures')} consecutive failures recorded")
        status = subprocess.run([s.wsync, "status"], env=s.env, capture_output=True, text=True).stdout
        check("cannot sync" in status and "corrupt" in status, "`wsync status` shows the sink's error")
        sink.proc.kill()
    finally:
        s.stop()


def reregister(build):
    s = system(build, "reregister", sinks=1)
    code = r"""
import sys, torch, wsync
sys.path.insert(0, "examples")
from tiny_llama import LlamaForCausalLM
src = wsync.Source(sys.argv[1]); snk = wsync.Sink(sys.argv[2])
torch.manual_seed(0)
trainer = LlamaForCausalLM().to(torch.bfloat16)
src.register(trainer)
first = LlamaForCausalLM().to(torch.bfloat16)
snk.register(first)
def same(a, b):
    return all(torch.equal(x.view(torch.int16), b.state_dict()[k].view(torch.int16)) for k, x in a.state_dict().items())
v = src.publish().version
assert snk.wait(v) == v and same(trainer, first)
# Registered again: other memory, a fresh model; the old one is written no more.
second = LlamaForCausalLM().to(torch.bfloat16)
snk.register(second)
with torch.no_grad():
    for p in trainer.parameters(): p.add_(1e-2)
# The trainer registers again too (its tensors move to new shared memory).
src.register(trainer)
before = {k: t.clone() for k, t in first.state_dict().items()}
v = src.publish().version
assert snk.wait(v) == v and same(trainer, second), "second registration synced"
assert all(torch.equal(before[k], t) for k, t in first.state_dict().items()), "old tensors untouched"
snk.unregister()
assert snk.status().tensors == 0
v = src.publish().version
try:
    snk.wait(v, timeout=1)
    raise SystemExit("wait after unregister succeeded")
except wsync.FailedPreconditionError as e:
    print("unregistered:", e.message)
src.unregister()
try:
    src.publish()
    raise SystemExit("publish after unregister succeeded")
except wsync.FailedPreconditionError as e:
    print("source unregistered:", e.message)
print("reregister ok")
"""
    try:
        p = run_client(s, build, code)
        check(p.returncode == 0 and "reregister ok" in p.stdout,
              "a sink registered again syncs into its new tensors and leaves the old ones alone; Unregister "
              "ends it; a source registered again and unregistered: " + (p.stdout + p.stderr)[-600:])
    finally:
        s.stop()


def daemon_restart(build):
    s = system(build, "daemon_restart", sinks=1)
    code = r"""
import os, sys, time, torch, wsync
sys.path.insert(0, "examples")
from tiny_llama import LlamaForCausalLM
d = sys.argv[3]
def pause(n):
    open(f"{d}/ready{n}", "w").close()
    while not os.path.exists(f"{d}/go{n}"):
        time.sleep(0.02)
torch.manual_seed(0)
trainer = LlamaForCausalLM()
opt = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
infer = LlamaForCausalLM().to(torch.bfloat16)
src = wsync.Source(sys.argv[1]); src.register(trainer)
snk = wsync.Sink(sys.argv[2]); snk.register(infer)
def step():
    ids = torch.randint(0, 512, (2, 16))
    torch.nn.functional.cross_entropy(trainer(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    opt.step(); opt.zero_grad()
    v = src.publish().version
    snk.wait(v, timeout=60)
    with snk.hold() as held:
        assert held == v, (held, v)
        for k, t in trainer.state_dict().items():
            assert torch.equal(t.to(torch.bfloat16).view(torch.int16), infer.state_dict()[k].view(torch.int16)), k
    return v
versions = [step(), step()]
pause(1)                 # the source daemon is SIGKILLed and restarted
versions.append(step())  # publish registers the trainer's memory again
pause(2)                 # the sink daemon is SIGKILLed and restarted
versions.append(step())  # wait registers the inference memory again, holding version 3
import threading
waited = {}
def waiter():
    waited["v"] = snk.wait(versions[-1] + 1, timeout=60)
th = threading.Thread(target=waiter)
th.start()
pause(3)                 # the sink daemon is SIGKILLed and restarted while wait() blocks
versions.append(step())
th.join()
assert waited.get("v") == versions[-1], (waited, versions)
print("daemon restart ok", versions)
"""
    try:
        p = subprocess.Popen([PY, "-c", code, local(s, "source"), local(s, "sink-0"), s.tmp],
                             env=dict(s.env, PYTHONPATH=os.path.join(build, "python")), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, cwd=os.path.join(HERE, "..", ".."))
        s.procs["worker-restart"] = (None, p)
        for n, daemon in ((1, "source"), (2, "sink-0"), (3, "sink-0")):
            s.wait_for(lambda: os.path.exists(f"{s.tmp}/ready{n}") or p.poll() is not None, f"pause {n}", 120)
            check(p.poll() is None, f"the client runs up to pause {n}")
            s.kill(daemon, signal.SIGKILL)
            s.restart(daemon)
            s.wait_for(lambda: subprocess.run([s.wsync, "local-status", "--local", local(s, daemon)], env=s.env,
                                              capture_output=True).returncode == 0, f"the restarted {daemon}")
            open(f"{s.tmp}/go{n}", "w").close()
        out, _ = p.communicate(timeout=180)
        check(p.returncode == 0 and "daemon restart ok [1, 2, 3, 4, 5]" in out,
              "the trainer and the inference server went on across the restarts, bit-exact, a wait() riding out "
              "the sink's: " + out.strip()[-300:])
        check("holding version 3" in s.log("sink-0") and "patch 3->4" in s.log("sink-0"),
              "the restarted sink took the buffers as version 3 and caught up with a patch 3->4")
    finally:
        s.stop()


def unconfirmed_publish(build):
    s = system(build, "unconfirmed_publish", sinks=1, source_args=["--inject-fail-announce", "3"])
    code = r"""
import sys, time, torch, wsync
sys.path.insert(0, "examples")
from tiny_llama import LlamaForCausalLM
torch.manual_seed(0)
trainer = LlamaForCausalLM().to(torch.bfloat16)
infer = LlamaForCausalLM().to(torch.bfloat16)
src = wsync.Source(sys.argv[1]); src.register(trainer)
snk = wsync.Sink(sys.argv[2]); snk.register(infer)
def step():
    with torch.no_grad():
        for p in trainer.parameters():
            p.view(torch.int16).view(-1)[::97] += 1
def same():
    return all(torch.equal(t.view(torch.int16), infer.state_dict()[k].view(torch.int16))
               for k, t in trainer.state_dict().items())
for _ in range(2):
    step(); v = src.publish().version; snk.wait(v); assert same()
step()
t0 = time.time()
try:
    src.publish(retry_for=5)  # version 3: its announce fails every time
    raise SystemExit("version 3 was published")
except wsync.UnavailableError as e:
    print(f"version 3 unconfirmed after {time.time() - t0:.1f} s of retries:", e.message[-90:])
step()             # the trainer goes on
try:
    src.publish(3)
    raise SystemExit("version 3 was published with the old weights")
except wsync.StaleVersionError as e:
    print("version 3 again with new weights refused:", e.reason, "next", e.next_version)
v = src.publish().version
snk.wait(v, timeout=60)
with snk.hold() as held:
    assert held == v == 4 and same(), (held, v)
print("unconfirmed ok")
"""
    try:
        p = run_client(s, build, code)
        check(p.returncode == 0 and "unconfirmed ok" in p.stdout and "VERSION_TAKEN next 4" in p.stdout,
              "an unconfirmed version is never published with other weights: " + (p.stdout + p.stderr)[-700:])
    finally:
        s.stop()


def slow_coordinator(build):
    """The coordinator stopped (SIGSTOP) for longer than a call's 5 s
    deadline, as in a slow failover: publish rides through it."""
    s = system(build, "slow_coordinator", sinks=1)
    code = r"""
import os, sys, time, torch, wsync
sys.path.insert(0, "examples")
from tiny_llama import LlamaForCausalLM
d = sys.argv[3]
torch.manual_seed(0)
trainer = LlamaForCausalLM().to(torch.bfloat16)
src = wsync.Source(sys.argv[1]); src.register(trainer)
src.publish()
open(f"{d}/ready", "w").close()
while not os.path.exists(f"{d}/stopped"):
    time.sleep(0.02)
with torch.no_grad():
    for p in trainer.parameters():
        p.view(torch.int16).view(-1)[::97] += 1
t0 = time.time()
open(f"{d}/publishing", "w").close()
v = src.publish().version
print(f"published {v} after {time.time() - t0:.1f} s")
"""
    try:
        p = subprocess.Popen([PY, "-c", code, local(s, "source"), local(s, "sink-0"), s.tmp],
                             env=dict(s.env, PYTHONPATH=os.path.join(build, "python")), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, cwd=os.path.join(HERE, "..", ".."))
        s.procs["worker-slow"] = (None, p)
        s.wait_for(lambda: os.path.exists(f"{s.tmp}/ready") or p.poll() is not None, "the first version", 120)
        check(p.poll() is None, "the client published version 1")
        s.kill("coordinator", signal.SIGSTOP)
        try:
            open(f"{s.tmp}/stopped", "w").close()
            s.wait_for(lambda: os.path.exists(f"{s.tmp}/publishing") or p.poll() is not None, "the publish", 60)
            # The fault lasts 8 s: past the source's 5 s deadline for its first
            # coordinator call, and past the ~4 s the client used to retry.
            time.sleep(8)
        finally:
            s.kill("coordinator", signal.SIGCONT)
        out, _ = p.communicate(timeout=120)
        check(p.returncode == 0 and "published 2" in out,
              "a publish rode through a coordinator stopped past the call deadline: " + out.strip()[-400:])
    finally:
        s.stop()


def sigterm(build):
    s = system(build, "sigterm", sinks=2)
    try:
        holder = Worker(s, "holder", "inference", local(s, "sink-1"), s.tmp, "h", "--until", "100", "--hold-forever")
        holder.wait_event("registered")
        t = Worker(s, "trainer", "trainer", local(s, "source"), s.tmp, "--steps", "1", "--lr", "1e-5")
        t.finish()
        holder.wait_event("holding")
        time.sleep(1.0)  # sink-0: idle, nothing registered; sink-1: its server holds
        for name in ("sink-0", "sink-1"):
            _, p = s.procs[name]
            t0 = time.monotonic()
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=10)
            took = time.monotonic() - t0
            check(took < 1.0, f"SIGTERM stopped {name} in {took:.2f} s")
        holder.proc.kill()
        for name in ("source", "coordinator"):
            _, p = s.procs[name]
            t0 = time.monotonic()
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=10)
            took = time.monotonic() - t0
            check(took < 1.0, f"SIGTERM stopped the {name} in {took:.2f} s")
    finally:
        s.stop()


def cuda_handle_forms(build):
    """The forms of CUDA IPC handle torch's `_share_cuda_` returns, without a GPU."""
    sys.path.insert(0, os.path.join(build, "python"))
    from wsync._tensors import cuda_mem_handle
    raw = bytes(range(64))
    check(cuda_mem_handle("t", raw) == raw, "torch 1.x: the bare cudaIpcMemHandle_t")
    for version in (1, 2, 3):
        check(cuda_mem_handle("t", bytes([version]) + b"c" + raw) == raw,
              f"torch 2.x, handle format {version}: a cudaMalloc block's handle after its two-byte header")
    for bad, what in ((bytes([2]) + b"e" + bytes(40), "expandable segment"),
                      (bytes([2]) + b"x" + raw, "unknown kind"), (raw[:10], "short")):
        try:
            cuda_mem_handle("model.w", bad)
            check(False, f"{what}: refused")
        except ValueError as e:
            check("model.w" in str(e) and ("expandable_segments:False" in str(e) or "does not know" in str(e)),
                  f"{what}: refused naming the tensor and the cause ({e})")


def gpu(build):
    probe = subprocess.run([PY, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True)
    if probe.stdout.strip() != "True":
        print("SKIP: gpu: no CUDA device visible to torch (Debian's torch is CPU-only; run on a GPU machine with a "
              "CUDA build of torch)")
        return
    code = r'''
import os, sys, torch, wsync
sys.path.insert(0, "examples")
from tiny_llama import LlamaForCausalLM
torch.manual_seed(0)
trainer = LlamaForCausalLM().cuda()
ptrs = {k: v.data_ptr() for k, v in trainer.state_dict().items()}
src = wsync.Source(sys.argv[1]); src.register(trainer)
assert ptrs == {k: v.data_ptr() for k, v in trainer.state_dict().items()}, "CUDA tensors were moved"
infer = LlamaForCausalLM().to(torch.bfloat16).cuda()
snk = wsync.Sink(sys.argv[2]); snk.register(infer)
opt = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
for step in range(4):
    trainer(torch.randint(0, 512, (2, 16), device="cuda")).float().mean().backward(); opt.step(); opt.zero_grad()
    v = src.publish().version
    snk.wait(v, timeout=60)
    with snk.hold():
        for k, t in trainer.state_dict().items():
            assert torch.equal(t.to(torch.bfloat16).view(torch.int16), infer.state_dict()[k].view(torch.int16)), k
print("gpu ok")
'''
    s = system(build, "gpu", sinks=1)
    try:
        p = run_client(s, build, code)
        check(p.returncode == 0 and "gpu ok" in p.stdout, "CUDA tensors sync bit-exactly over IPC: " + p.stderr[-500:])
    finally:
        s.stop()
    # A trainer in GPU memory serving tensor-parallel ranks: the source codes
    # the tile grids on the device; each rank holds its pieces in GPU memory.
    code = r'''
import os, sys, torch, wsync
from wsync import layouts
sys.path.insert(0, "examples"); sys.path.insert(0, "tests/python")
from tiny_llama import LlamaForCausalLM
from client_workers import tiny_config
torch.manual_seed(0)
trainer = LlamaForCausalLM().cuda()
tp = [layouts.tp_layout(tiny_config(), 2, r) for r in range(2)]
src = wsync.Source(sys.argv[1]); src.register(trainer, serve=tp)
canonical = {k: v.to(torch.bfloat16) for k, v in LlamaForCausalLM().state_dict().items()}
ranks = []
for r in range(2):
    runtime = {k: v.cuda() for k, v in layouts.shard(canonical, tp[r]).items()}
    snk = wsync.Sink(sys.argv[2 + r]); snk.register(runtime, layout=tp[r])
    ranks.append((snk, runtime))
opt = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
for step in range(4):
    trainer(torch.randint(0, 512, (2, 16), device="cuda")).float().mean().backward(); opt.step(); opt.zero_grad()
    v = src.publish().version
    want = {k: t.to(torch.bfloat16).cpu() for k, t in trainer.state_dict().items()}
    for r, (snk, runtime) in enumerate(ranks):
        snk.wait(v, timeout=60)
        with snk.hold():
            expect = layouts.shard(want, tp[r])
            for k, t in runtime.items():
                assert torch.equal(t.cpu().view(torch.int16), expect[k].view(torch.int16)), (r, k)
print("gpu tp ok")
'''
    s = system(build, "gpu_tp", sinks=2)
    try:
        p = run_client(s, build, code, local(s, "sink-1"))
        check(p.returncode == 0 and "gpu tp ok" in p.stdout,
              "a GPU trainer serves tensor-parallel ranks in GPU memory bit-exactly: " + p.stderr[-500:])
    finally:
        s.stop()


SCENARIOS = {
    "train_lr1e-6": lambda b: train(b, "1e-6"),
    "train_lr1e-5": lambda b: train(b, "1e-5"),
    "sigkill_holder": sigkill_holder,
    "mismatch": mismatch,
    "persistent_failure": persistent_failure,
    "reregister": reregister,
    "daemon_restart": daemon_restart,
    "unconfirmed_publish": unconfirmed_publish,
    "slow_coordinator": slow_coordinator,
    "sigterm": sigterm,
    "tensor_parallel": tensor_parallel,
    "resized_fleet": resized_fleet,
    "offered_layouts": offered_layouts,
    "two_sources": two_sources,
    "gpu": gpu,
    "cuda_handle_forms": cuda_handle_forms,
}

if __name__ == "__main__":
    build = os.path.abspath(sys.argv[1])
    names = sys.argv[2:] or list(SCENARIOS)
    for n in names:
        SCENARIOS[n](build)
    for d in SCENARIO_DIRS:
        shutil.rmtree(d, ignore_errors=True)
    print("client tests: all passed")
