"""Helpers for the Python integration tests: stubs generated from our proto
with protoc + grpc_python_plugin, and a `wsyncd coordinator` subprocess."""
import atexit
import os
import shutil
import subprocess
import sys
import tempfile


def generate_stubs(proto_dir):
    """Generates wsync/v1/coordinator_pb2{,_grpc}.py (and local_pb2.py,
    whose layout messages the coordinator's import); returns (pb, rpc)."""
    out = tempfile.mkdtemp(prefix="wsync_stubs_")
    atexit.register(shutil.rmtree, out, True)
    subprocess.check_call([
        "protoc", f"--proto_path={proto_dir}", f"--python_out={out}", f"--grpc_out={out}",
        "--plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin",
        os.path.join(proto_dir, "wsync/v1/coordinator.proto"), os.path.join(proto_dir, "wsync/v1/local.proto")])
    sys.path.insert(0, out)
    from wsync.v1 import coordinator_pb2, coordinator_pb2_grpc  # noqa: E402
    return coordinator_pb2, coordinator_pb2_grpc


class Coordinator:
    """A wsyncd coordinator on a unix socket in a fresh directory."""

    def __init__(self, wsyncd, token, extra=()):
        self.dir = tempfile.mkdtemp(prefix="wsync_coord_")
        self.sock = os.path.join(self.dir, "coord.sock")
        self.address = f"unix:{self.sock}"
        env = dict(os.environ, WSYNC_TOKEN=token)
        self.proc = subprocess.Popen([wsyncd, "coordinator", "--listen", self.address, *extra], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def channel(self):
        import grpc
        ch = grpc.insecure_channel(self.address)
        grpc.channel_ready_future(ch).result(timeout=10)
        return ch

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)
