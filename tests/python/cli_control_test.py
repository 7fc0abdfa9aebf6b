#!/usr/bin/python3
"""`wsync status / versions / leases / nodes` against a real coordinator:
tables and --json show what was registered, published and leased; errors
(unreachable, unauthenticated, bad address) are one line and exit 1.

    cli_control_test.py WSYNC WSYNCD PROTO_DIR
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from wsync_testlib import Coordinator, generate_stubs  # noqa: E402


def run(wsync, *args, env=None, ok=True):
    p = subprocess.run([wsync, *args], capture_output=True, text=True, env=env, timeout=30)
    if ok:
        assert p.returncode == 0, (args, p.stdout, p.stderr)
    return p


def main():
    wsync, wsyncd, proto_dir = sys.argv[1:4]
    pb, rpc = generate_stubs(proto_dir)
    token = "cli-token"
    coord = Coordinator(wsyncd, token, extra=["--max-staleness", "3"])
    try:
        stub = rpc.CoordinatorStub(coord.channel())
        md = [("authorization", f"Bearer {token}")]
        stub.Register(pb.RegisterRequest(name="trainer", role=pb.ROLE_SOURCE, host="10.0.0.1"), metadata=md)
        stub.Register(pb.RegisterRequest(name="rollout-7", role=pb.ROLE_SINK, host="10.0.0.2"), metadata=md)
        for v in (1, 2, 3):
            stub.Publish(pb.PublishRequest(version=pb.VersionSummary(
                version=v, base_version=v - 1, keyframe=(v == 1), patch_bytes=1000, dense_bytes=100000,
                source="trainer")), metadata=md)
        stub.ReportApplied(pb.ReportAppliedRequest(name="rollout-7", version=2), metadata=md)
        stub.AcquireLease(pb.AcquireLeaseRequest(node="rollout-7", version=2, ttl_ms=60000), metadata=md)

        env = dict(os.environ, WSYNC_COORDINATOR=coord.address, WSYNC_TOKEN=token)
        out = run(wsync, "status", env=env).stdout
        assert "head version 3" in out and "max staleness 3" in out, out
        row = [line for line in out.splitlines() if line.startswith("rollout-7")]
        assert row and row[0].split()[1:6] == ["sink", "alive", "10.0.0.2", "2", "1"], out
        assert "trainer" in row[0], out  # its parent
        status = json.loads(run(wsync, "status", "--json", env=env).stdout)
        assert status["headVersion"] == "3" and len(status["nodes"]) == 2, status

        out = run(wsync, "versions", env=env).stdout
        assert len([line for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]) == 3, out
        assert "keyframe" in out and "100.0x" in out, out
        versions = json.loads(run(wsync, "versions", "--after", "2", "--json", env=env).stdout)
        assert [v["version"] for v in versions["versions"]] == ["3"], versions

        out = run(wsync, "leases", env=env).stdout
        assert "oldest leased version: 2" in out and "rollout-7" in out, out
        nodes = json.loads(run(wsync, "nodes", "--json", env=env).stdout)
        assert sorted(n["name"] for n in nodes["nodes"]) == ["rollout-7", "trainer"], nodes

        # Errors: one line, exit 1.
        bad_token = dict(env, WSYNC_TOKEN="wrong")
        p = run(wsync, "status", env=bad_token, ok=False)
        assert p.returncode == 1 and "Unauthenticated" in p.stderr and p.stderr.count("\n") == 1, p.stderr
        p = run(wsync, "status", "--coordinator", "127.0.0.1:1", env=env, ok=False)
        assert p.returncode == 1 and "Unavailable" in p.stderr and p.stderr.count("\n") == 1, p.stderr
        p = run(wsync, "status", "--coordinator", "nohost", env=env, ok=False)
        assert p.returncode == 1 and "not host:port" in p.stderr, p.stderr
        no_addr = {k: v for k, v in env.items() if k != "WSYNC_COORDINATOR"}
        p = run(wsync, "versions", env=no_addr, ok=False)
        assert p.returncode == 1 and "WSYNC_COORDINATOR" in p.stderr, p.stderr
        print("PASS: wsync status/versions/leases/nodes")
    finally:
        coord.stop()

    # A fleet past the heartbeat budget (here one a second): each sink is
    # asked for a heartbeat every nodes/budget seconds, and status says so.
    coord = Coordinator(wsyncd, token, extra=["--heartbeat-budget", "1"])
    try:
        stub = rpc.CoordinatorStub(coord.channel())
        md = [("authorization", f"Bearer {token}")]
        for name in ("rollout-1", "rollout-2", "rollout-3"):  # 3 s apart each, above a quarter of 10 s
            stub.Register(pb.RegisterRequest(name=name, role=pb.ROLE_SINK, host="10.0.0.2"), metadata=md)
        hb = stub.Heartbeat(pb.HeartbeatRequest(name="rollout-1"), metadata=md)
        assert hb.heartbeat_interval_ms == 3000, hb
        env = dict(os.environ, WSYNC_COORDINATOR=coord.address, WSYNC_TOKEN=token)
        out = run(wsync, "status", env=env).stdout
        assert "a heartbeat every 3.0 s each, dead after four missed" in out, out
        print("PASS: a fleet past --heartbeat-budget is paced and `wsync status` says so")
    finally:
        coord.stop()


if __name__ == "__main__":
    main()
