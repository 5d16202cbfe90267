"""ZeroMQ CURVE on tcp:// channels: key files, socket roles, and the ZAP allow-list.

Roles: the side that binds (every PULL) is the CURVE *server*; the side that connects (every
PUSH) is a CURVE *client* that must know the server's public key, so it can never hand a frame
to an impostor that lacks the server's secret. Each process that binds runs one ZAP handler per
ZMQ context (``zmq.auth.thread.ThreadAuthenticator``) that admits only the client public keys in
``authorized_clients/``; anyone else is refused during the handshake and logged. Because the
handshake comes first, no frame from an unauthenticated peer ever reaches a decoder, and every
frame on the wire is encrypted.

Key directory (``tandem keys generate DIR``, files as ``zmq.auth.create_certificates`` writes):

    DIR/server.key, DIR/server.key_secret        binders (scheduler, worker, front)
    DIR/client.key, DIR/client.key_secret        connectors (every process, the supervisor)
    DIR/authorized_clients/*.key                  client public keys the binders accept

ipc:// channels inside the 0700 run directory need none of this (the file mode is the guard).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass

import zmq
import zmq.auth

# ``zmq.auth.thread`` and ``zmq.utils.monitor`` import asyncio (~8 MB resident in every process);
# they are imported where a tcp:// channel first needs them, so ipc-only processes never load them.

log = logging.getLogger("tandem.security")
ZAP_DOMAIN = "tandem"
AUTHORIZED_DIR = "authorized_clients"
LOG_EVERY_S = 1.0  # refusals are logged at most once a second per socket (a scanner can't flood logs)
# Handshake failures other than an auth refusal: a plain-text or wrong-mechanism peer.
_FAIL_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class CurveKeyError(ValueError):
    """Missing or unreadable key files; the message names the file."""


@dataclass(frozen=True)
class CurveKeys:
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    authorized: frozenset[bytes]  # z85 client public keys the binding side accepts


def generate_keys(directory: str) -> CurveKeys:
    """Write a server and a client key pair (secrets 0600, directories 0700) and authorize the
    client. Refuses to overwrite an existing key set."""
    if os.path.exists(os.path.join(directory, "server.key_secret")):
        raise CurveKeyError(f"{directory}: already holds a key set (server.key_secret); not overwriting")
    auth_dir = os.path.join(directory, AUTHORIZED_DIR)
    os.makedirs(auth_dir, exist_ok=True)
    for d in (directory, auth_dir):
        os.chmod(d, 0o700)
    for name in ("server", "client"):
        _, secret_file = zmq.auth.create_certificates(directory, name)
        os.chmod(secret_file, 0o600)
    with open(os.path.join(directory, "client.key")) as src, open(os.path.join(auth_dir, "client.key"), "w") as dst:
        dst.write(src.read())
    return load_keys(directory)


def _load_pair(path: str) -> tuple[bytes, bytes]:
    if not os.path.isfile(path):
        raise CurveKeyError(f"missing key file {path} (make one with: tandem keys generate DIR)")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (ValueError, OSError) as exc:
        raise CurveKeyError(f"{path}: {exc}") from None
    if secret is None:
        raise CurveKeyError(f"{path}: no secret key in it")
    return public, secret


def load_keys(directory: str) -> CurveKeys:
    server_public, server_secret = _load_pair(os.path.join(directory, "server.key_secret"))
    client_public, client_secret = _load_pair(os.path.join(directory, "client.key_secret"))
    auth_dir = os.path.join(directory, AUTHORIZED_DIR)
    if not os.path.isdir(auth_dir):
        raise CurveKeyError(f"missing directory {auth_dir} (the client public keys to accept)")
    try:
        authorized = frozenset(zmq.auth.load_certificates(auth_dir))
    except (ValueError, OSError) as exc:
        raise CurveKeyError(f"{auth_dir}: {exc}") from None
    if not authorized:
        raise CurveKeyError(f"{auth_dir}: no *.key file, so no client could connect")
    return CurveKeys(server_public, server_secret, client_public, client_secret, authorized)


class _RateLimitedLog:
    def __init__(self) -> None:
        self.last = 0.0
        self.suppressed = 0
        self.lock = threading.Lock()

    def warn(self, fmt: str, *args) -> None:
        with self.lock:
            now = time.monotonic()
            if now - self.last < LOG_EVERY_S:
                self.suppressed += 1
                return
            more = f" (+{self.suppressed} more refused)" if self.suppressed else ""
            self.last, self.suppressed = now, 0
        log.warning(fmt + more, *args)


class _AllowList:
    """ZAP credentials provider: a known client key passes, anything else is refused and logged."""

    def __init__(self, keys: frozenset[bytes]):
        self.keys = keys
        self.refusals = _RateLimitedLog()

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        self.refusals.warn("refused a ZMQ peer with unknown CURVE key %s", key.decode(errors="replace"))
        return False


class _Guard:
    """One ZAP handler per context, shared by that context's server sockets (ref-counted: the
    handler's own sockets must be closed before the context can terminate)."""

    def __init__(self, ctx: zmq.Context, keys: CurveKeys):
        from zmq.auth.thread import ThreadAuthenticator  # noqa: PLC0415 (tcp:// only)

        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("tandem.security.zap"))
        self.auth.start()
        self.auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_AllowList(keys.authorized))
        self.users = 0


_MONITOR_IDS = itertools.count()


def _parse_event(frames: list[bytes]) -> dict:
    from zmq.utils.monitor import parse_monitor_message  # noqa: PLC0415 (tcp:// only)

    return parse_monitor_message(frames)


def _monitor_pair(sock: zmq.Socket, events: int) -> zmq.Socket:
    """A plain PAIR socket receiving ``sock``'s monitor events (plain even on an asyncio
    context, so it can be polled without an event loop)."""
    # A fresh name each time: an id() is reused once its socket is freed, and a monitor endpoint
    # of a closed socket may still be bound while libzmq tears it down.
    addr = f"inproc://tandem-monitor-{next(_MONITOR_IDS)}"
    sock.monitor(addr, events)
    pair = sock.context.socket(zmq.PAIR, socket_class=zmq.Socket)
    pair.connect(addr)
    return pair


class _Monitor:
    """Logs handshake failures on one server socket (a plain-text peer never reaches ZAP)."""

    def __init__(self, sock: zmq.Socket, channel: str):
        self.sock, self.channel = sock, channel
        self.pair = _monitor_pair(sock, _FAIL_EVENTS)
        self.stop_event = threading.Event()
        self.refusals = _RateLimitedLog()
        self.thread = threading.Thread(target=self._run, name=f"curve-monitor-{channel}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop_event.is_set():
            if not self.pair.poll(200):
                continue
            try:
                event = _parse_event(self.pair.recv_multipart())
            except zmq.ZMQError:
                return
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                continue  # the ZAP allow-list logged it, with the key
            self.refusals.warn("refused a ZMQ peer on the %s channel (%s): CURVE handshake failed "
                               "(plain-text or wrong-mechanism peer, error %s)", self.channel,
                               event.get("endpoint", b"").decode(errors="replace"), event["value"])

    def close(self) -> None:
        self.stop_event.set()
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.thread.join(2.0)  # the thread reads the pair until it stops
        self.pair.close(linger=0)


class ChannelRefused(RuntimeError):
    """The peer of a tcp:// channel refused the CURVE handshake: the two sides hold different
    keys (or the address is not a Tandem process). The message names the channel and address."""


_HANDSHAKE = _FAIL_EVENTS | zmq.EVENT_HANDSHAKE_SUCCEEDED


class HandshakeWatch:
    """A connector's CURVE handshake outcomes on one tcp:// socket, read without blocking.

    A peer that keeps failing the handshake (other keys, no CURVE, not a Tandem process) would
    swallow every frame: zmq queues them, or, once the refusal dropped the pipe, a blocking send
    waits for good. ``check`` raises ChannelRefused after ``limit`` failures in a row (no success
    between them), or at once after a ZMTP protocol failure (a mechanism mismatch: the peer runs
    without CURVE): zmq never reconnects after one, and the pipe it sometimes keeps would queue
    every later frame for good."""

    def __init__(self, sock: zmq.Socket, channel: str, address: str):
        self.sock, self.channel, self.address = sock, channel, address
        self.pair = _monitor_pair(sock, _HANDSHAKE)
        self.failures, self.last = 0, None

    def check(self, limit: int) -> None:
        while self.pair.poll(0):
            event = _parse_event(self.pair.recv_multipart())
            ok = event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
            self.failures, self.last = (0, None) if ok else (self.failures + 1, event)
        final = self.last is not None and self.last["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        if self.failures >= limit or final:
            raise ChannelRefused(
                f"{self.channel} channel {self.address}: {self.failures} CURVE handshake(s) in a row failed "
                f"(zmq event {int(self.last['event'])}, error {self.last['value']}); both sides must use the "
                "same key set (--curve-keys-dir), and the address must be a Tandem process")

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.pair.close(linger=0)


class Curve:
    """The CURVE policy of one process: keys, plus the ZAP handlers it started."""

    def __init__(self, keys: CurveKeys):
        self.keys = keys
        self._guards: dict[int, _Guard] = {}
        self._monitors: dict[int, _Monitor] = {}
        self._lock = threading.Lock()

    def server(self, sock: zmq.Socket, channel: str) -> None:
        """Before bind: CURVE server role, ZAP required (no handler = no connection)."""
        ctx = sock.context
        with self._lock:
            guard = self._guards.get(ctx.underlying)
            if guard is None:
                guard = self._guards[ctx.underlying] = _Guard(ctx, self.keys)
            guard.users += 1
        sock.curve_secretkey = self.keys.server_secret
        sock.curve_publickey = self.keys.server_public
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN.encode()
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        self._monitors[id(sock)] = _Monitor(sock, channel)

    def client(self, sock: zmq.Socket) -> None:
        """Before connect: authenticate ourselves and require the server's known public key."""
        sock.curve_secretkey = self.keys.client_secret
        sock.curve_publickey = self.keys.client_public
        sock.curve_serverkey = self.keys.server_public

    def release(self, sock: zmq.Socket) -> None:
        """A server socket is closing: stop its monitor, and the context's ZAP handler with the last."""
        monitor = self._monitors.pop(id(sock), None)
        if monitor is None:
            return
        monitor.close()
        with self._lock:
            key = sock.context.underlying
            guard = self._guards.get(key)
            if guard is not None:
                guard.users -= 1
                if guard.users <= 0:
                    guard.auth.stop()
                    del self._guards[key]
