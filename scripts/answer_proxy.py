"""A gRPC proxy in front of one coordinator replica that can lose answers.

Every call is forwarded to the replica with its metadata and deadline, and
the replica's answer (or error, with its details) is passed back, except
while `lose` is above 0: then each unary call's answer is dropped with that
probability after the replica answered it (the call took effect; the caller
sees UNAVAILABLE, as when a connection breaks after the leader committed),
and `lost` counts the answers dropped by method. Streams (Watch) are passed
through. Needs Python's grpcio, nothing of wsync's: it forwards bytes.
"""
import collections
import random
import threading
from concurrent import futures

import grpc

STREAMING = {"/wsync.v1.Coordinator/Watch"}
# Metadata the proxy's own channel sets: not forwarded.
_TRANSPORT = ("user-agent", "grpc-")


class _Status(collections.namedtuple("_Status", ("code", "details", "trailing_metadata")), grpc.Status):
    pass


class AnswerProxy:
    def __init__(self, listen, upstream, seed=0):
        self.upstream = grpc.insecure_channel(upstream)
        self.lose = 0.0
        self.lost = collections.Counter()
        self.rng = random.Random(seed)
        self.mu = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
        self.server.add_generic_rpc_handlers((_Handler(self),))
        if self.server.add_insecure_port(listen) == 0:
            raise RuntimeError(f"answer proxy cannot listen on {listen}")
        self.server.start()

    def stop(self):
        self.server.stop(grace=None)
        self.upstream.close()

    def _losing(self, method):
        with self.mu:
            if self.lose <= 0 or self.rng.random() >= self.lose:
                return False
            self.lost[method.rsplit("/", 1)[-1]] += 1
            return True


def _forwarded(context):
    return [(k, v) for k, v in context.invocation_metadata() if not k.startswith(_TRANSPORT) and not k.startswith(":")]


def _abort_as(context, error):
    context.abort_with_status(_Status(error.code(), error.details() or "", error.trailing_metadata() or ()))


class _Handler(grpc.GenericRpcHandler):
    def __init__(self, proxy):
        self.proxy = proxy

    def service(self, details):
        method = details.method
        if method in STREAMING:
            return grpc.unary_stream_rpc_method_handler(lambda req, ctx: self._stream(method, req, ctx))
        return grpc.unary_unary_rpc_method_handler(lambda req, ctx: self._unary(method, req, ctx))

    def _unary(self, method, request, context):
        try:
            answer = self.proxy.upstream.unary_unary(method)(request, metadata=_forwarded(context),
                                                             timeout=context.time_remaining())
        except grpc.RpcError as e:
            _abort_as(context, e)
        if self.proxy._losing(method):
            context.abort(grpc.StatusCode.UNAVAILABLE, "answer lost by the test's proxy after the replica answered")
        return answer

    def _stream(self, method, request, context):
        call = self.proxy.upstream.unary_stream(method)(request, metadata=_forwarded(context),
                                                         timeout=context.time_remaining())
        context.add_callback(call.cancel)
        try:
            for message in call:
                yield message
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                _abort_as(context, e)
