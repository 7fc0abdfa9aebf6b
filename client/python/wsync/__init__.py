"""wsync: lossless sparse weight sync from RL trainers to inference servers.

    src = wsync.Source("unix:/run/wsync/source.sock")   # next to the trainer
    src.register(model)
    src.publish(step)

    snk = wsync.Sink("unix:/run/wsync/sink.sock")       # next to the inference server
    snk.register(model)
    with snk.hold() as version:
        generate(...)
"""
from .errors import (AbortedError, DataLossError, DeadlineExceededError, FailedPreconditionError,
                     InvalidArgumentError, NotFoundError, StaleVersionError, UnavailableError, WsyncError)
from .sink import Sink
from .source import PublishStats, RegisterInfo, Source

__all__ = [
    "Source", "Sink", "RegisterInfo", "PublishStats",
    "WsyncError", "InvalidArgumentError", "NotFoundError", "FailedPreconditionError", "StaleVersionError",
    "AbortedError", "UnavailableError", "DeadlineExceededError", "DataLossError",
]
