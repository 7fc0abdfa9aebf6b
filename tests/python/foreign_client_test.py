#!/usr/bin/python3
"""A foreign client: Debian's python3-grpcio with stubs generated from our
proto (protoc + grpc_python_plugin) publishes, watches and reads status
against a real `wsyncd coordinator`, proving the proto is usable outside C++.

    foreign_client_test.py WSYNCD PROTO_DIR
"""
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from wsync_testlib import Coordinator, generate_stubs  # noqa: E402


def main():
    wsyncd, proto_dir = sys.argv[1], sys.argv[2]
    pb, rpc = generate_stubs(proto_dir)
    import grpc  # Debian's python3-grpcio

    token = "py-token"
    daemon = Coordinator(wsyncd, token)
    try:
        stub = rpc.CoordinatorStub(daemon.channel())
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

        # Issue 18, item 6: reflection answered without the token. It is off
        # unless --reflection: the method does not exist.
        reflect = daemon.channel().stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
        try:
            list(reflect(iter([b"\x3a\x00"]), timeout=5))  # list_services = ""
            raise AssertionError("reflection answered without --reflection")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNIMPLEMENTED, e.code()
        print("PASS: python client published, watched and read status; reflection is off")
    finally:
        daemon.stop()


if __name__ == "__main__":
    main()
