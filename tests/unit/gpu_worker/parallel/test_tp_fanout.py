"""Plan fan-out between TP ranks, without models: rank 0 forwards exactly the frames it
accepted (a malformed frame reaches no follower), in order, Shutdown included; a follower
launches each plan it receives, in order, and stops on Shutdown."""

from __future__ import annotations

import threading

import msgspec
import zmq

from gpu_worker.tp_worker import Follower, Leader
from common.args import ServerArgs
from proto.messages import Shutdown, StepPlan
from proto.transport import ipc_endpoints

ENC = msgspec.msgpack.Encoder()


def _args() -> ServerArgs:
    return ServerArgs(model_path="unused", tp_size=2, device="cpu")


def test_leader_forwards_accepted_frames_only(tmp_path):
    leader = Leader(_args(), ipc_endpoints(str(tmp_path)), "unused")
    sink = leader.ctx.socket(zmq.PULL)
    sink.bind(f"ipc://{tmp_path}/follower.sock")
    out = leader.ctx.socket(zmq.PUSH)
    out.connect(f"ipc://{tmp_path}/follower.sock")
    leader.fanout.append(out)
    feed = leader.ctx.socket(zmq.PUSH)
    feed.connect(leader.plans.sock.getsockopt_string(zmq.LAST_ENDPOINT))
    frames = [ENC.encode(StepPlan(1, free=[3])), b"\x93garbage", ENC.encode(StepPlan(2)), ENC.encode(Shutdown("bye"))]
    try:
        for f in frames:
            feed.send(f)
        assert leader._recv(block=True) == StepPlan(1, free=[3])
        assert leader._recv(block=False, timeout_ms=2000) == StepPlan(2)  # the garbage is skipped
        assert leader._recv(block=True) == Shutdown("bye")
        assert leader._recv(block=False, timeout_ms=10) is None
        got = [sink.recv() for _ in range(3)]
        assert got == [frames[0], frames[2], frames[3]]  # byte for byte, in order
        assert not sink.poll(50)
    finally:
        for s in (sink, feed):
            s.close(linger=0)
        leader.close()


class _Runner:
    def __init__(self):
        self.launched: list[int] = []

    def launch(self, plan, retire=None):
        self.launched.append(plan.step_id)
        return type("P", (), {"event": None, "on_tokens": None, "ready": lambda self: True})()


def test_follower_launches_in_order_and_stops_on_shutdown():
    follower = Follower(_args(), 1, "unused")
    follower.runner = _Runner()
    push = follower.ctx.socket(zmq.PUSH)
    push.connect(follower.address)
    try:
        for i in range(5):
            push.send(ENC.encode(StepPlan(i)))
        push.send(ENC.encode(Shutdown()))
        t = threading.Thread(target=follower.run, daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive()
        assert follower.runner.launched == [0, 1, 2, 3, 4]
    finally:
        push.close(linger=0)
        follower.close()
