"""Run the real HTTP front (tokenizer_proc.main.FrontServer) in a thread against FakeEngine.

Everything goes through real ZMQ ipc sockets and a real uvicorn listener on an ephemeral port,
so tests can use the official ``openai`` client and raw httpx.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
from dataclasses import dataclass

import httpx

from common.args import ServerArgs
from proto.transport import ipc_endpoints, make_run_dir
from tests.unit.fake_engine import FakeEngine
from tests.unit.front_tok import shared_tokenizer_dir
from tokenizer_proc.main import FrontServer
from tokenizer_proc.tokenizer import TextTokenizer

MODEL = "fake-model"


class FrontThread:
    def __init__(self, args: ServerArgs, endpoints):
        self.args, self.endpoints = args, endpoints
        self.statuses: list[tuple[str, str | None]] = []
        self.ready = threading.Event()
        self.started = threading.Event()
        self.exit_code: int | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="front", daemon=True)

    def _status(self, kind: str, detail: str | None) -> None:
        self.statuses.append((kind, detail))
        self.ready.set()

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        try:
            self.server = FrontServer(self.args, self.endpoints, self._status)
            self.port = self.server.port
            self.started.set()
            self.exit_code = self.loop.run_until_complete(self.server.serve())
        except BaseException as exc:  # noqa: BLE001 - surfaced to the test
            self.error = exc
            self.started.set()
            self.ready.set()
        finally:
            self.loop.close()

    def start(self) -> FrontThread:
        self.thread.start()
        assert self.started.wait(10), "front did not start"
        if self.error:
            raise self.error
        return self

    def request_stop(self) -> None:
        self.loop.call_soon_threadsafe(self.server.request_stop)

    def join(self, timeout: float = 15.0) -> None:
        self.thread.join(timeout)


@dataclass
class Stack:
    front: FrontThread
    fake: FakeEngine
    tok: TextTokenizer
    run_dir: str

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.front.port}"

    @property
    def engine(self):
        return self.front.server.engine

    def close(self) -> None:
        if self.front.thread.is_alive():
            self.front.request_stop()
            self.front.join()
        self.fake.stop()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def start_stack(wait_ready: bool = True, send_info: bool = True, tok_dir: str | None = None,
                **arg_overrides) -> Stack:
    """``tok_dir``: another tokenizer directory (default: the shared chatml one)."""
    tok_dir = tok_dir or shared_tokenizer_dir("chatml")
    tok = TextTokenizer(tok_dir)
    run_dir = make_run_dir()
    endpoints = ipc_endpoints(run_dir)
    fields = dict(model_path=tok_dir, served_model_name=MODEL, port=0, log_level="warning", shutdown_timeout=1.0)
    fields.update(arg_overrides)
    args = ServerArgs(**fields)
    fake = FakeEngine(endpoints, vocab_size=tok.vocab_size, eos_id=tok.eos_id)
    front = FrontThread(args, endpoints).start()
    fake.start(send_info=send_info)
    stack = Stack(front, fake, tok, run_dir)
    if wait_ready:
        assert front.ready.wait(10), "front never reported ready"
        assert front.statuses[-1] == ("ready", None), front.statuses
        if send_info and args.warmup:
            # The fake reports stats every 50 ms (the real scheduler reports at once on going
            # idle): wait until a report has seen the warm-up end, or admission tests would count
            # the finished warm-up as still in transit.
            assert fake.wait_for(lambda: _stats_caught_up(stack.engine)), "stats never caught up"
    return stack


def _stats_caught_up(engine) -> bool:
    s = engine.last_stats
    return s is not None and s.requests_received == engine.sent_generate and s.num_running == 0


def assert_error(r: httpx.Response, status: int = 400, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    assert err["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
    if param is not None:
        assert err["param"] == param, err
    return err
