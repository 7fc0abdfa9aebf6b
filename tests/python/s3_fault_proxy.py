"""An HTTP proxy in front of an S3-compatible server that fails some
ranged GETs the way a store or a CDN does: HTTP 503 with an S3 error body,
or the announced Content-Length cut short (the connection closed midway).
Everything else passes through unchanged (the Host header too, so that
SigV4 signatures still verify)."""
import http.client
import http.server
import random
import threading


class S3FaultProxy:
    def __init__(self, backend_port, unavailable=0.2, truncated=0.2, seed=1):
        rng = random.Random(seed)
        lock = threading.Lock()
        self.injected = {"503": 0, "truncated": 0, "passed": 0}
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
                fault = None
                if self.command == "GET" and "Range" in self.headers:
                    with lock:
                        x = rng.random()
                    fault = "503" if x < unavailable else "truncated" if x < unavailable + truncated else None
                if fault == "503":
                    with lock:
                        proxy.injected["503"] += 1
                    msg = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                conn = http.client.HTTPConnection("127.0.0.1", backend_port, timeout=30)
                headers = {k: v for k, v in self.headers.items()}
                conn.request(self.command, self.path, body=body if body else None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                # A HEAD's length is the object's, as the server said.
                length = resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length)
                if fault == "truncated" and len(data) > 1:
                    with lock:
                        proxy.injected["truncated"] += 1
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(data[:len(data) // 2])
                    self.close_connection = True
                    return
                with lock:
                    proxy.injected["passed"] += 1
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def endpoint(self):
        return f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.shutdown()
        self.server.server_close()
