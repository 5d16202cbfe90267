"""Child processes as fresh interpreters, started with ``subprocess`` rather than multiprocessing.

multiprocessing's spawn and forkserver start methods each start a resource-tracker process
(~13 MB resident for the server's lifetime) that Tandem's children never use: they share no
semaphores or shared memory, only ZeroMQ sockets and one status pipe each. ``ChildProcess`` runs
``target(*args, **kwargs)`` in a new interpreter the way spawn does (the parent's ``sys.path``
and interpreter flags, stdin on /dev/null, arguments pickled by reference), and offers the part
of ``multiprocessing.Process`` the supervisor uses: ``pid``, ``sentinel``, ``is_alive``,
``exitcode``, ``join``, ``terminate``, ``kill``.

A ``multiprocessing.connection.Connection`` among the arguments (the child's status end) crosses
as its file descriptor: the child inherits that descriptor and rebuilds the connection on it.
"""

from __future__ import annotations

import io
import os
import pickle
import signal
import subprocess
import sys
import traceback
import weakref
from multiprocessing.connection import Connection
from typing import Any, BinaryIO, Callable

# Reads the parent's sys.path first, so ``tandem`` imports wherever the parent found it.
_BOOTSTRAP = ("import os, pickle, sys\n"
              "with os.fdopen(int(sys.argv[1]), 'rb') as f:\n"
              "    sys.path[:] = pickle.load(f)\n"
              "    from tandem.launch import run_child\n"
              "    run_child(f)\n")


class _Pickler(pickle.Pickler):
    """Pickles a Connection as ("fd", its descriptor) and records the descriptor to pass on."""

    def __init__(self, file: BinaryIO):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.fds: list[int] = []

    def persistent_id(self, obj: Any) -> tuple[str, int, bool, bool] | None:
        if isinstance(obj, Connection):
            self.fds.append(obj.fileno())
            return ("fd", obj.fileno(), obj.readable, obj.writable)
        return None


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid: tuple[str, int, bool, bool]) -> Connection:
        kind, fd, readable, writable = pid
        if kind != "fd":
            raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")
        return Connection(fd, readable=readable, writable=writable)


def _dump_job(target: Callable, args: tuple, kwargs: dict) -> tuple[bytes, list[int]]:
    buf = io.BytesIO()
    pickle.dump(list(sys.path), buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler = _Pickler(buf)
    pickler.dump((target, args, kwargs))
    return buf.getvalue(), pickler.fds


def _exit_code(exc: SystemExit) -> int:
    """As multiprocessing reports a child's ``sys.exit(x)``: None is 0, an int itself, else 1."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    sys.stderr.write(f"{exc.code}\n")
    return 1


def run_child(payload: BinaryIO) -> None:
    """The child's side: run the pickled target; an uncaught exception prints its traceback and
    exits 1, as a multiprocessing child does."""
    try:
        target, args, kwargs = _Unpickler(payload).load()
        target(*args, **kwargs)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:  # noqa: BLE001 (the child's last word: logged, then exit 1)
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


class ChildProcess:
    """One child interpreter running ``target(*args, **kwargs)``; see the module docstring."""

    def __init__(self, target: Callable, args: tuple = (), kwargs: dict | None = None, name: str = ""):
        self.target, self.args, self.kwargs, self.name = target, args, kwargs or {}, name
        self._popen: subprocess.Popen | None = None
        self.sentinel = -1

    def start(self) -> None:
        data, fds = _dump_job(self.target, self.args, self.kwargs)
        payload_r, payload_w = os.pipe()
        # The child holds the write end until it exits: the read end, our sentinel, then reads EOF.
        sentinel_r, sentinel_w = os.pipe()
        cmd = [sys.executable, *subprocess._args_from_interpreter_flags(), "-c", _BOOTSTRAP, str(payload_r)]
        try:
            self._popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, pass_fds=(payload_r, sentinel_w, *fds))
        finally:
            os.close(payload_r)
            os.close(sentinel_w)
        self.sentinel = sentinel_r
        weakref.finalize(self, os.close, sentinel_r)
        with open(payload_w, "wb") as f:  # after the start: a payload past the pipe's buffer waits for the reader
            f.write(data)

    @property
    def pid(self) -> int | None:
        return None if self._popen is None else self._popen.pid

    @property
    def exitcode(self) -> int | None:
        """None while it runs; minus the signal number when a signal ended it."""
        return None if self._popen is None else self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        if self._popen is None:
            return
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self._popen is not None:
            self._popen.send_signal(signal.SIGTERM)  # a no-op once it has been reaped

    def kill(self) -> None:
        if self._popen is not None:
            self._popen.send_signal(signal.SIGKILL)
