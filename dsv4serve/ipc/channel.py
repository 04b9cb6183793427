"""A pair of ZeroMQ PUSH/PULL sockets over `ipc://` endpoints, unique per launch.

The API process binds both endpoints in a fresh private folder; the worker connects. Neither side
ever waits forever: every receive takes a timeout.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from dsv4serve.ipc.messages import Codec, FromWorker, ToWorker


@dataclass(frozen=True)
class Endpoints:
    to_worker: str
    from_worker: str


def new_endpoints() -> tuple[Endpoints, Path]:
    """Fresh endpoint names in a private temporary folder (removed by the caller)."""
    folder = Path(tempfile.mkdtemp(prefix="dsv4serve-ipc-"))
    return Endpoints(f"ipc://{folder}/to-worker", f"ipc://{folder}/from-worker"), folder


class _Side:
    def __init__(
        self, ctx: zmq.Context, send_addr: str, recv_addr: str, bind: bool, send_codec: Codec, recv_codec: Codec
    ):
        self._ctx = ctx
        self._send = ctx.socket(zmq.PUSH)
        self._recv = ctx.socket(zmq.PULL)
        for sock in (self._send, self._recv):
            sock.setsockopt(zmq.LINGER, 0)
        if bind:
            self._send.bind(send_addr)
            self._recv.bind(recv_addr)
        else:
            self._send.connect(send_addr)
            self._recv.connect(recv_addr)
        self._send_codec, self._recv_codec = send_codec, recv_codec

    def send(self, message: msgspec.Struct) -> None:
        self._send.send(self._send_codec.encode(message), copy=False)

    def recv(self, timeout_s: float):
        """The next message, or None after `timeout_s` (0 = do not wait)."""
        if not self._recv.poll(int(timeout_s * 1000)):
            return None
        return self._recv_codec.decode(self._recv.recv(copy=False).bytes)

    def close(self) -> None:
        self._send.close(0)
        self._recv.close(0)


class ApiChannel(_Side):
    """The API process's end: sends ToWorker, receives FromWorker."""

    def __init__(self, endpoints: Endpoints, folder: Path):
        self._folder = folder
        super().__init__(
            zmq.Context.instance(), endpoints.to_worker, endpoints.from_worker, True, Codec(ToWorker), Codec(FromWorker)
        )

    def close(self) -> None:
        super().close()
        shutil.rmtree(self._folder, ignore_errors=True)


class WorkerChannel(_Side):
    """The worker's end: sends FromWorker, receives ToWorker."""

    def __init__(self, endpoints: Endpoints):
        super().__init__(
            zmq.Context.instance(),
            endpoints.from_worker,
            endpoints.to_worker,
            False,
            Codec(FromWorker),
            Codec(ToWorker),
        )


class ReportChannel:
    """A worker process other than the scheduler's (a tensor-parallel rank > 0): it may only send FromWorker
    messages (its start-up failure). It never receives: a second reader of `to_worker` would take messages
    meant for rank 0."""

    def __init__(self, from_worker: str):
        self._send: zmq.Socket = zmq.Context.instance().socket(zmq.PUSH)
        self._send.setsockopt(zmq.LINGER, 1000)
        self._send.connect(from_worker)
        self._codec = Codec(FromWorker)

    def send(self, message: msgspec.Struct) -> None:
        self._send.send(self._codec.encode(message), copy=False)

    def close(self) -> None:
        self._send.close()
