"""Tensor-parallel worker processes: rank 0 leads, ranks 1..N-1 follow.

The scheduler is unchanged: it sends each plan once, to rank 0's plans socket, and reads
results from rank 0 only. Rank 0 forwards each frame it received, byte for byte (after its
typed decode accepted it), to every follower over a ZMQ PUSH -> PULL pair in the follower's
private 0700 directory, then launches it. Every rank runs ``runner.launch(plan)`` on the same
plans in the same order, so they issue the same collectives and, from the same gathered
logits and counter-based seeds, sample the same tokens: their slot state stays identical
without any per-step exchange besides the model's all-reduces.

Why ZMQ and not a torch.distributed broadcast for the plans: an idle engine would leave the
followers blocked inside a collective until its timeout fired; a ZMQ recv waits for ever at
no cost, and the step's collectives pace the ranks anyway. Every rank keeps the leader's
overlap depth (3 by default): each launches plans ahead of the step it waits on.

Failure: a rank that dies (or fails at start-up) is a dead child of the supervisor, which
fails in-flight requests and stops every process; peers blocked in a collective or a socket
wait are stopped with the rest (SIGTERM, then SIGKILL after the grace period). A restart must
restart every rank together: they form one process group.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections import deque

import msgspec
import torch
import zmq

from gpu_worker.main import Worker, build_runner, inflight_limit
from gpu_worker.main import run as run_worker
from gpu_worker.parallel import comm
from gpu_worker.parallel.state import all_gather_object, destroy_tp, init_tp
from common.args import ServerArgs
from proto.messages import PlanMsg, Shutdown, StepPlan
from proto.transport import Endpoints, make_run_dir

log = logging.getLogger("tandem.worker")


def _join(args: ServerArgs, rank: int, init_method: str) -> None:
    init_tp(rank, args.tp_size, init_method, torch.device(args.resolved_device()))
    comm.warmup()  # communicators exist before any CUDA-graph capture


class Leader(Worker):
    """Rank 0: the ordinary worker, plus forwarding every plan frame to the followers."""

    def __init__(self, args: ServerArgs, ep: Endpoints, init_method: str):
        super().__init__(args, ep)
        self.init_method = init_method
        self.fanout: list[zmq.Socket] = []

    def setup(self):
        _join(self.args, 0, self.init_method)
        ready = super().setup()
        for addr in all_gather_object(None)[1:]:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # never drop a plan; frames queue until connected
            sock.connect(addr)
            self.fanout.append(sock)
        return ready

    def _recv(self, block: bool, timeout_ms: int = 0) -> StepPlan | Shutdown | None:
        sock = self.plans.sock
        while True:
            if not block and not sock.poll(timeout_ms):
                return None
            frame = sock.recv(copy=False)
            try:
                msg = self.plans.decoder.decode(frame.buffer)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.error("dropping malformed plan frame: %s", exc)  # followers never see it
                continue
            for out in self.fanout:
                out.send(frame, copy=False)
            return msg

    def close(self) -> None:
        for sock in self.fanout:
            sock.close(linger=0)
        super().close()
        destroy_tp()


class Follower:
    """Rank r > 0: receive rank 0's plan frames, launch each, send nothing back."""

    def __init__(self, args: ServerArgs, rank: int, init_method: str):
        self.args, self.rank, self.init_method = args, rank, init_method
        self.depth = inflight_limit(args)  # the leader's
        self.ctx = zmq.Context()
        self.dir = make_run_dir()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.address = f"ipc://{self.dir}/plans.sock"
        self.sock.bind(self.address)
        self.decoder = msgspec.msgpack.Decoder(PlanMsg)

    def setup(self) -> None:
        _join(self.args, self.rank, self.init_method)
        self.runner, _ = build_runner(self.args)
        all_gather_object(self.address)

    def run(self) -> None:
        inflight: deque = deque()
        while True:
            msg = self.decoder.decode(self.sock.recv(copy=False).buffer)  # rank 0 decoded it already
            if isinstance(msg, Shutdown):
                break
            inflight.append(self.runner.launch(msg, retire=lambda: _retire_all(inflight)))
            # Same depth as the leader: at most that many steps launched, retire the oldest in
            # order (its copy buffers stay alive until its event has fired).
            while inflight and (inflight[0].ready() or len(inflight) >= self.depth):
                _retire(inflight.popleft())
        _retire_all(inflight)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)
        destroy_tp()


def _retire_all(inflight: deque) -> None:
    """Every step in flight, oldest first (also a constrained step's ``retire``, as on the leader)."""
    while inflight:
        _retire(inflight.popleft())


def _retire(pending) -> None:
    """Wait for the step; its tokens advance this rank's grammar matchers as on the leader."""
    if pending.on_tokens is not None:
        pending.result()
    elif pending.event is not None:
        pending.event.synchronize()


def run_follower(args: ServerArgs, rank: int, init_method: str, status_conn=None) -> None:
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(name)s[tp{rank}] %(levelname)s %(message)s")
    worker = Follower(args, rank, init_method)
    try:
        try:
            worker.setup()
        except Exception as exc:  # one line to the supervisor, then exit non-zero
            if isinstance(exc, (ValueError, FileNotFoundError, RuntimeError)):
                log.error("worker rank %d start-up failed: %s", rank, exc)
            else:
                log.exception("worker rank %d start-up failed", rank)
            if status_conn is not None:
                status_conn.send(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
            raise SystemExit(1) from None
        worker.run()
    finally:
        worker.close()


def run_rank(args: ServerArgs, endpoints: Endpoints, status_conn=None, rank: int = 0,
             init_method: str | None = None) -> None:
    """Process entry point of worker rank ``rank`` (the supervisor spawns one per rank). Once the
    worker has shut down (or failed with its one-line error) the process ends without the
    interpreter's teardown: Triton's compiled modules, torn down there, print a report of
    "leaked" nanobind objects that only outlive their module, and nothing is left to run."""
    code = 0
    try:
        _run_rank(args, endpoints, status_conn, rank, init_method)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_rank(args: ServerArgs, endpoints: Endpoints, status_conn, rank: int, init_method: str | None) -> None:
    if args.tp_size == 1:
        return run_worker(args, endpoints, status_conn)
    if init_method is None:
        raise ValueError("--tp-size > 1 needs a rendezvous (init_method) from the supervisor")
    if rank == 0:
        return run_worker(args, endpoints, status_conn, worker=Leader(args, endpoints, init_method))
    return run_follower(args, rank, init_method, status_conn)
