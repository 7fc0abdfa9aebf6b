#!/usr/bin/python3
"""The coordinator at fleet scale, before and after in one run: for each
build given (BUILD, and --baseline BUILD), `wsyncd coordinator` processes
(one in memory, then three replicas over a three-member etcd cluster on
loopback, Debian's etcd-server) are driven by this build's `wsync-bench
control --fleet`: every simulated sink heart-beats and reports each version
at the rate a fleet of that size makes at the daemons' defaults. The same
driver measures every coordinator, interleaved by sink count. Prints, per
sink count, coordinator and build: the RPC rate offered and served, the
heartbeat p50/p99, how soon the coordinator knows a sink's applied version
(p99: a ReportApplied call's latency, or, when the coordinator takes applied
versions from heartbeats, from the apply to the answer of the heartbeat that
carried it), the calls that started late, and (each
sink holding its Watch stream open, as sink daemons do; --no-watch: none)
the time from a version's publish to every watcher's receipt of it.

    bench_control.py --build build [--baseline OLD_BUILD] [--sinks 1000,10000,30000] [--seconds 20]
                     [--heartbeat-ms 2500] [--publish-every-ms 5000] [--report-spread-ms 1000]
                     [--where memory,etcd] [--no-watch]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from system_demo import EtcdCluster, free_ports  # noqa: E402


class Coordinators:
    """`wsyncd coordinator` processes of one build: one in memory, or three
    replicas over `etcd` (each run with a fresh etcd prefix)."""

    def __init__(self, wsyncd, tmp, etcd=None, prefix=""):
        self.procs = []
        ports = free_ports(3 if etcd else 1)
        self.addresses = [f"127.0.0.1:{p}" for p in ports]
        for i, address in enumerate(self.addresses):
            argv = [wsyncd, "coordinator", "--listen", address]
            if etcd:
                argv += ["--etcd", etcd.endpoints(), "--advertise", address, "--etcd-prefix", prefix]
            log = open(os.path.join(tmp, f"coordinator-{prefix.strip('/') or 'memory'}-{i}.log"), "w")
            self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))

    def stop(self):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def how(r):
    """How the coordinator learnt applied versions: a ReportApplied call each, or the heartbeats."""
    return "heartbeats" if r.get("reports_on_heartbeats") else "reports"


def period(r, args):
    """Each sink's heartbeat period: the driver's, or the one the coordinator paced the fleet to."""
    paced = r.get("heartbeat_paced_ms", 0)
    return f"{max(paced, args.heartbeat_ms) / 1000:.1f} s" + (" (paced)" if paced > args.heartbeat_ms else "")


def drive(bench, addresses, sinks, args):
    argv = [bench, "--json", "control", "--fleet", "--sinks", str(sinks), "--seconds", str(args.seconds),
            "--heartbeat-ms", str(args.heartbeat_ms), "--publish-every-ms", str(args.publish_every_ms),
            "--report-spread-ms", str(args.report_spread_ms),
            "--coordinator", ",".join(addresses)] + (["--no-watch"] if args.no_watch else [])
    p = subprocess.run(argv, capture_output=True, text=True, timeout=args.seconds + 900)
    try:
        return json.loads(p.stdout)["external"]
    except (ValueError, KeyError):
        raise RuntimeError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr[-2000:]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--baseline", help="an earlier build's directory: its wsyncd measured by the same driver")
    ap.add_argument("--sinks", default="1000,10000,30000")
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--heartbeat-ms", type=int, default=2500, help="each sink's heartbeat period (the daemons': their TTL / 4)")
    ap.add_argument("--publish-every-ms", type=int, default=5000)
    ap.add_argument("--report-spread-ms", type=int, default=1000, help="sinks report a version within this")
    ap.add_argument("--where", default="memory,etcd", help="which coordinators: memory, etcd or both")
    ap.add_argument("--no-watch", action="store_true", help="the simulated sinks hold no Watch streams")
    args = ap.parse_args()
    if shutil.which("etcd") is None:
        sys.exit("etcd is not installed (scripts/install-deps.sh installs etcd-server)")
    bench = os.path.join(args.build, "bench", "wsync-bench")
    builds = [("this build", os.path.join(args.build, "daemon", "wsyncd"))]
    if args.baseline:
        builds.insert(0, ("baseline", os.path.join(args.baseline, "daemon", "wsyncd")))
    tmp = tempfile.mkdtemp(prefix="wsync_bench_control_")
    etcd = EtcdCluster(tmp)
    rows = []
    try:
        run = 0
        for sinks in [int(s) for s in args.sinks.split(",")]:
            for where in [w for k, w in (("memory", "in memory"), ("etcd", "3 replicas over etcd"))
                          if k in args.where.split(",")]:
                for name, wsyncd in builds:
                    run += 1
                    c = Coordinators(wsyncd, tmp, etcd if "etcd" in where else None, f"/bench-{run}")
                    try:
                        time.sleep(1.5)  # listening, and a replica elected
                        r = drive(bench, c.addresses, sinks, args)
                    finally:
                        c.stop()
                    rows.append((sinks, where, name, r))
                    print(f"{sinks:>6} sinks, {where:<21} {name:<10}: heartbeats every {period(r, args)}, "
                          f"{r['offered_rpcs_per_s']:7.0f} RPCs/s offered, "
                          f"{r['steady_rpcs_per_s']:7.0f} served; heartbeat p50 {r['heartbeat']['p50_us'] / 1000:6.2f} "
                          f"p99 {r['heartbeat']['p99_us'] / 1000:7.2f} ms; applied known p99 "
                          f"{r['report_applied']['p99_us'] / 1000:7.2f} ms ({how(r)}); watch p99 "
                          f"{r['watch_delivery']['p99_us'] / 1000:7.2f} ms; {r['late_calls']} late, "
                          f"{r['register_per_s']:.0f} registrations/s, "
                          f"{r['errors']} errors", flush=True)
    finally:
        etcd.stop()
    print("\n| sinks | coordinator | build | heartbeat period | RPCs/s offered | served | heartbeat p50 / p99 "
          "| applied known p99 | version to every watcher p50 / p99 | late calls | registrations/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for sinks, where, name, r in rows:
        print(f"| {sinks:,} | {where} | {name} | {period(r, args)} | {r['offered_rpcs_per_s']:,.0f} | {r['steady_rpcs_per_s']:,.0f} | "
              f"{r['heartbeat']['p50_us'] / 1000:.2f} / {r['heartbeat']['p99_us'] / 1000:.2f} ms | "
              f"{r['report_applied']['p99_us'] / 1000:.2f} ms ({how(r)}) | "
              f"{r['watch_delivery']['p50_us'] / 1000:.2f} / {r['watch_delivery']['p99_us'] / 1000:.2f} ms | "
              f"{r['late_calls']:,} | {r['register_per_s']:,.0f} |")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
