"""ZeroMQ PUSH/PULL channels carrying one msgspec frame per message.

Addresses are ``ipc://`` paths inside a private 0700 run directory by default, or ``tcp://``.
Invariant: a ``tcp://`` channel is always CURVE-encrypted and authenticated (``proto/curve.py``);
a process must call ``use_curve`` with its keys before opening one, or the channel refuses to
open. Decoding is typed: a malformed or unknown frame raises ``msgspec.DecodeError`` /
``msgspec.ValidationError`` in the receiver, which logs and drops it, never crashes.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import msgspec
import zmq

from proto.curve import ChannelRefused, Curve, CurveKeys, HandshakeWatch, load_keys
from proto.messages import OutputMsg, PlanMsg, RequestMsg, ResultMsg

if TYPE_CHECKING:  # asyncio is the front's alone: the scheduler, worker and supervisor never load it
    import zmq.asyncio

T = TypeVar("T")

CHANNEL_TYPES: dict[str, Any] = {
    "requests": RequestMsg,
    "outputs": OutputMsg,
    "plans": PlanMsg,
    "results": ResultMsg,
}


@dataclass(frozen=True)
class Endpoints:
    """Where each channel's PULL side binds."""

    requests: str
    outputs: str
    plans: str
    results: str
    curve_dir: str | None = None  # CURVE key directory for tcp:// (see proto/curve.py)

    def address(self, channel: str) -> str:
        return getattr(self, channel)


def make_run_dir(parent: str | None = None) -> str:
    """A private directory for ipc sockets: mode 0700, so other users cannot connect."""
    path = tempfile.mkdtemp(prefix="tandem-", dir=parent)
    os.chmod(path, 0o700)
    return path


def ipc_endpoints(run_dir: str) -> Endpoints:
    return Endpoints(**{name: f"ipc://{run_dir}/{name}.sock" for name in CHANNEL_TYPES})


def tcp_endpoints(host: str, base_port: int, curve_dir: str | None = None) -> Endpoints:
    names = list(CHANNEL_TYPES)
    return Endpoints(**{n: f"tcp://{host}:{base_port + i}" for i, n in enumerate(names)}, curve_dir=curve_dir)


# The CURVE policy of this process (None: ipc only). Set once by the process entry point.
_CURVE: Curve | None = None


def use_curve(keys: CurveKeys | None) -> None:
    global _CURVE
    _CURVE = Curve(keys) if keys is not None else None


def use_endpoint_security(endpoints: Endpoints) -> None:
    """Load the keys ``endpoints`` names (a process entry point calls this before any channel)."""
    use_curve(load_keys(endpoints.curve_dir) if endpoints.curve_dir else None)


def _secure(sock: zmq.Socket, address: str, channel: str, server: bool) -> None:
    if not address.startswith("tcp://"):
        return
    if _CURVE is None:
        raise RuntimeError(f"{channel} channel {address}: tcp:// needs CURVE keys (none configured)")
    if server:
        _CURVE.server(sock, channel)
    else:
        _CURVE.client(sock)


def _close(sock: zmq.Socket) -> None:
    if _CURVE is not None:
        _CURVE.release(sock)
    sock.close(linger=0)


class _Codec(Generic[T]):
    def __init__(self, channel: str):
        self.channel = channel
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(CHANNEL_TYPES[channel])


def _socket_opts(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


# Consecutive failed handshakes (no success between them) that mean "refused": zmq retries
# every ~0.15 s, and a peer that restarts mid-handshake fails once, not five times in a row.
REFUSED_AFTER = 5
WAIT_POLL_MS = 200


def _watch(sock: zmq.Socket, channel: str, address: str) -> HandshakeWatch | None:
    return HandshakeWatch(sock, channel, address) if address.startswith("tcp://") else None


class PushChannel(_Codec[T]):
    """Sending side. Connects (the PULL side binds), so peers may start in any order.

    A send queues while the peer is not up yet (HWM unbounded). On tcp:// each send reads the
    handshake watch first (ChannelRefused after REFUSED_AFTER failures in a row); a send with no
    pipe waits in slices and raises at the first failure (a peer that merely restarts leaves the
    pipe in place: its frames queue)."""

    def __init__(self, ctx: zmq.Context, channel: str, address: str):
        super().__init__(channel)
        self.sock = ctx.socket(zmq.PUSH)
        _socket_opts(self.sock)
        _secure(self.sock, address, channel, server=False)
        self.watch = _watch(self.sock, channel, address)
        self.sock.connect(address)

    def send(self, msg: T) -> None:
        frame = self.encoder.encode(msg)
        if self.watch is None:
            self.sock.send(frame, copy=False)
            return
        limit = REFUSED_AFTER
        while True:
            self.watch.check(limit)
            try:
                self.sock.send(frame, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:  # no pipe: a refusal dropped it (zmq may never retry)
                limit = 1
                self.sock.poll(WAIT_POLL_MS, zmq.POLLOUT)

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
        _close(self.sock)


class PullChannel(_Codec[T]):
    """Receiving side; binds its address."""

    def __init__(self, ctx: zmq.Context, channel: str, address: str):
        super().__init__(channel)
        self.sock = ctx.socket(zmq.PULL)
        _socket_opts(self.sock)
        _secure(self.sock, address, channel, server=True)
        self.sock.bind(address)

    def recv(self, timeout_ms: int | None = None) -> T | None:
        """Next message, or None on timeout (None = wait forever, 0 = poll)."""
        if timeout_ms is not None and not self.sock.poll(timeout_ms):
            return None
        return self.decoder.decode(self.sock.recv(copy=False).buffer)

    def close(self) -> None:
        _close(self.sock)


class AsyncPushChannel(_Codec[T]):
    """The front's sending side. PUSH with an unbounded HWM queues while a pipe exists, so the
    send is synchronous and safe in a handler. On tcp:// it reads the handshake watch as
    ``PushChannel`` does, and a frame with no pipe to take it raises ChannelRefused instead of
    vanishing in an unawaited future."""

    def __init__(self, ctx: zmq.asyncio.Context, channel: str, address: str):
        super().__init__(channel)
        self.sock = ctx.socket(zmq.PUSH)
        _socket_opts(self.sock)
        _secure(self.sock, address, channel, server=False)
        self.address, self.watch = address, _watch(self.sock, channel, address)
        self.sync = zmq.Socket.shadow(self.sock.underlying)  # the same socket, plain calls
        self.sock.connect(address)

    def send_nowait(self, msg: T) -> None:
        frame = self.encoder.encode(msg)
        if self.watch is not None:
            self.watch.check(REFUSED_AFTER)
        try:
            self.sync.send(frame, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            if self.watch is not None:
                self.watch.check(1)
            raise ChannelRefused(f"{self.channel} channel {self.address}: no connection takes frames") from None

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
        _close(self.sock)


class AsyncPullChannel(_Codec[T]):
    def __init__(self, ctx: zmq.asyncio.Context, channel: str, address: str):
        super().__init__(channel)
        self.sock = ctx.socket(zmq.PULL)
        _socket_opts(self.sock)
        _secure(self.sock, address, channel, server=True)
        self.sock.bind(address)

    async def recv(self) -> T:
        frame = await self.sock.recv(copy=False)
        return self.decoder.decode(frame.buffer)

    def close(self) -> None:
        _close(self.sock)
