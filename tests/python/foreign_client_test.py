#!/usr/bin/python3
"""A foreign client: Debian's python3-grpcio with stubs generated from our
proto (protoc + grpc_python_plugin) publishes, watches and reads status
against a real `wsyncd coordinator`, proving the proto is usable outside C++.

    foreign_client_test.py WSYNCD PROTO_DIR
"""
import os
import subprocess
import sys
import tempfile
import threading
import time


def main():
    wsyncd, proto_dir = sys.argv[1], sys.argv[2]
    tmp = tempfile.mkdtemp(prefix="wsync_py_")
    subprocess.check_call([
        "protoc", f"--proto_path={proto_dir}", f"--python_out={tmp}", f"--grpc_out={tmp}",
        "--plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin",
        os.path.join(proto_dir, "wsync/v1/coordinator.proto")])
    sys.path.insert(0, tmp)
    import grpc  # Debian's python3-grpcio
    from wsync.v1 import coordinator_pb2 as pb
    from wsync.v1 import coordinator_pb2_grpc as rpc

    sock = os.path.join(tmp, "coord.sock")
    token = "py-token"
    env = dict(os.environ, WSYNC_TOKEN=token)
    daemon = subprocess.Popen([wsyncd, "coordinator", "--listen", f"unix:{sock}"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        channel = grpc.insecure_channel(f"unix:{sock}")
        grpc.channel_ready_future(channel).result(timeout=10)
        stub = rpc.CoordinatorStub(channel)
        md = [("authorization", f"Bearer {token}")]

        # Without the token: Unauthenticated.
        try:
            stub.Status(pb.StatusRequest(), timeout=5)
            raise AssertionError("status without a token succeeded")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e.code()

        stub.Register(pb.RegisterRequest(name="py-trainer", role=pb.ROLE_SOURCE, host="py"), metadata=md, timeout=5)
        seen = []
        done = threading.Event()

        def watch():
            for v in stub.Watch(pb.WatchRequest(after=0), metadata=md, timeout=20):
                seen.append(v.version)
                if v.version == 3:
                    done.set()
                    return

        t = threading.Thread(target=watch)
        t.start()
        for v in (1, 2, 3):
            stub.Publish(pb.PublishRequest(version=pb.VersionSummary(
                version=v, base_version=v - 1, keyframe=(v == 1), patch_bytes=100 * v,
                dense_bytes=12_600_000, source="py-trainer")), metadata=md, timeout=5)
        assert done.wait(15), f"watch saw only {seen}"
        t.join()
        assert seen == [1, 2, 3], seen

        try:
            stub.Publish(pb.PublishRequest(version=pb.VersionSummary(version=2)), metadata=md, timeout=5)
            raise AssertionError("a smaller version was accepted")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e.code()

        status = stub.Status(pb.StatusRequest(), metadata=md, timeout=5)
        assert status.head_version == 3, status
        assert [n.name for n in status.nodes] == ["py-trainer"], status
        print("PASS: python client published, watched and read status")
    finally:
        daemon.terminate()
        daemon.wait(timeout=10)


if __name__ == "__main__":
    main()
