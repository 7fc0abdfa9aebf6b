"""SeaweedFS, a real S3-compatible server, on loopback for tests and
benchmarks: one process (master, volume, filer, S3 gateway) in a directory
of its own, with a writer and a read-only identity. Its binary comes from
scripts/install-seaweedfs.sh ($WSYNC_SEAWEEDFS overrides where)."""
import glob
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request

WRITER = ("wsync-writer", "wsync-writer-secret")
READER = ("wsync-reader", "wsync-reader-secret")


def binary():
    return os.environ.get("WSYNC_SEAWEEDFS",
                          os.path.expanduser("~/.cache/wsync/seaweedfs-4.48/bin/weed"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SeaweedFS:
    """bind: the address its ports listen on (0.0.0.0: also reachable from
    network namespaces, at their veth's address)."""

    def __init__(self, tmp, bind="127.0.0.1"):
        self.dir = os.path.join(tmp, "seaweedfs")
        os.makedirs(os.path.join(self.dir, "data"), exist_ok=True)
        os.makedirs(os.path.join(self.dir, "log"), exist_ok=True)
        ids = [{"name": "writer", "credentials": [{"accessKey": WRITER[0], "secretKey": WRITER[1]}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"]},
               {"name": "reader", "credentials": [{"accessKey": READER[0], "secretKey": READER[1]}],
                "actions": ["Read", "List"]}]
        with open(os.path.join(self.dir, "s3.json"), "w") as f:
            json.dump({"identities": ids}, f)
        self.ports = [free_port() for _ in range(8)]
        self.s3_port, self.filer_port = self.ports[0], self.ports[1]
        master, master_grpc, volume, volume_grpc, filer_grpc, s3_grpc = self.ports[2:]
        argv = [binary(), f"-logdir={self.dir}/log", "server", "-ip=127.0.0.1", f"-ip.bind={bind}",
                f"-dir={self.dir}/data", f"-master.port={master}", f"-master.port.grpc={master_grpc}",
                f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}", "-filer",
                f"-filer.port={self.filer_port}", f"-filer.port.grpc={filer_grpc}", "-s3",
                f"-s3.port={self.s3_port}", f"-s3.port.grpc={s3_grpc}", "-s3.port.iceberg=0",
                "-s3.port.lance=0", f"-s3.config={self.dir}/s3.json", f"-s3.localSocket={self.dir}/s3.sock",
                f"-filer.localSocket={self.dir}/filer.sock", "-master.volumeSizeLimitMB=64",
                "-volume.max=16", "-volume.preStopSeconds=0"]
        if not os.path.exists(argv[0]):
            raise RuntimeError(f"no SeaweedFS at {argv[0]} (run scripts/install-seaweedfs.sh)")
        self.proc = subprocess.Popen(argv, stdout=open(os.path.join(self.dir, "server.log"), "w"),
                                     stderr=subprocess.STDOUT)

    def endpoint(self, host="127.0.0.1"):
        return f"http://{host}:{self.s3_port}"

    def url(self, bucket, host="127.0.0.1"):
        return f"s3://{bucket}?endpoint={self.endpoint(host)}"

    def create_bucket(self, bucket, timeout=90):
        """Waits for the filer, makes the bucket (a directory of its
        /buckets), then waits for the S3 gateway to answer."""
        end = time.time() + timeout

        def wait(what, attempt):
            while True:
                try:
                    return attempt()
                except OSError as e:  # refused, or an error status while the server starts
                    if time.time() > end or self.proc.poll() is not None:
                        raise RuntimeError(f"SeaweedFS: {what}: {e}; log in {self.dir}")
                    time.sleep(0.2)

        wait("the bucket", lambda: urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{self.filer_port}/buckets/{bucket}/", method="POST"), timeout=5))

        def gateway():
            try:
                urllib.request.urlopen(self.endpoint(), timeout=5)
            except urllib.error.HTTPError:
                pass  # it answers (anonymous requests are refused)
        wait("the S3 gateway", gateway)

    @staticmethod
    def env(identity):
        return dict(os.environ, AWS_ACCESS_KEY_ID=identity[0], AWS_SECRET_ACCESS_KEY=identity[1])

    def signal(self, sig):
        self.proc.send_signal(sig)

    def stop(self):
        self.proc.kill()
        self.proc.wait()
        # The gRPC servers' unix sockets it always makes in /tmp, named by port.
        for p in self.ports:
            for f in glob.glob(f"/tmp/seaweedfs-*-{p}.sock"):
                os.unlink(f)
