"""Process entry point of the HTTP front.

Start-up: load the tokenizer, bind the HTTP port and the outputs channel (failures here are
reported on ``status_conn`` as ("error", one line)), serve right away with /health at 503, wait
for EngineInfo, send one warm-up request round the whole loop, then report ("ready", None) and
turn /health to 200.

SIGTERM / SIGINT: stop accepting (new requests and /health get 503), let in-flight requests
finish for up to ``--shutdown-timeout`` seconds, fail the rest with an error, send Shutdown to
the scheduler, stop uvicorn, exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import threading
from typing import Callable

import uvicorn

from common.args import ServerArgs
from common.jinja_env import read_template_source
from proto.transport import Endpoints
from tokenizer_proc.app import build_app
from tokenizer_proc.chat_template import ChatTemplate
from tokenizer_proc.context import Front
from tokenizer_proc.engine_client import DEAD, DRAINING, READY, STARTING, EngineClient
from tokenizer_proc.metrics import Metrics
from tokenizer_proc.params import load_generation_defaults
from tokenizer_proc.serving_native import run_probe

log = logging.getLogger("tandem.front")
WARMUP_TIMEOUT_S = 600.0
StatusFn = Callable[[str, str | None], None]


class StartupError(RuntimeError):
    """A fatal start-up problem; the message is the one line the supervisor prints."""


def build_front(args: ServerArgs, endpoints: Endpoints) -> Front:
    from tokenizer_proc.tokenizer import TextTokenizer, TokenizerError  # noqa: PLC0415

    try:
        tok = TextTokenizer(args.tokenizer_dir)
    except (TokenizerError, ValueError, OSError) as exc:
        raise StartupError(f"tokenizer: {exc}") from exc
    try:
        override = read_template_source(args.chat_template) if args.chat_template is not None else None
        template = ChatTemplate.from_tokenizer(tok, override)
    except ValueError as exc:  # checked by the CLI already; a file may have changed since
        raise StartupError(f"--chat-template: {exc}") from exc
    if template.is_fallback:
        log.warning("no chat template in %s: chat requests are rendered as plain 'role: content' lines; "
                    "give the model's template with --chat-template", args.tokenizer_dir)
    metrics = Metrics(args.model_name, args.metrics_compat)
    engine = EngineClient(args, endpoints, metrics)
    return Front(args, tok, template, engine, metrics, load_generation_defaults(args.model_path))


def bind_http(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class FrontServer:
    """Owns uvicorn, the engine client and the life cycle; usable in-process by tests."""

    def __init__(self, args: ServerArgs, endpoints: Endpoints, status: StatusFn):
        self.args = args
        self.status = status
        self.front = build_front(args, endpoints)
        self.sock = bind_http(args.host, args.port)
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(build_app(self.front), log_level=args.log_level, access_log=False,
                                timeout_graceful_shutdown=5, lifespan="off")
        self.server = uvicorn.Server(config)
        self._stopping = False
        self._drain_deadline = 0.0

    @property
    def engine(self) -> EngineClient:
        return self.front.engine

    async def serve(self) -> int:
        try:
            self.engine.open()
        except Exception as exc:  # noqa: BLE001 - zmq errors have many types
            raise StartupError(f"cannot bind outputs channel {self.engine.endpoints.outputs}: {exc}") from exc
        self.engine.start()
        self.engine.on_restart = self._on_engine_restart
        self._install_signals()
        # _serve, not serve: serve() installs uvicorn's own SIGTERM handler (immediate exit), and
        # we need ours (drain first).
        server_task = asyncio.create_task(self.server._serve([self.sock]), name="uvicorn")  # noqa: SLF001
        startup = asyncio.create_task(self._startup(), name="startup")
        await asyncio.wait({server_task, startup}, return_when=asyncio.FIRST_COMPLETED)
        code = 0
        if startup.done() and startup.exception() is not None:
            exc = startup.exception()
            self.status("error", str(exc))
            self.server.should_exit = True
            code = 1
        elif not startup.done():
            startup.cancel()
        await server_task
        await self.engine.close()
        return code

    async def _startup(self) -> None:
        await self.engine.info_event.wait()
        if self.engine.phase == DEAD:
            raise StartupError(f"engine died during start-up: {self.engine.dead_reason}")
        info = self.engine.info
        log.info("engine: %s on %s, context %d, %d pages x %d", info.architecture, info.device,
                 info.max_context, info.num_pages, info.page_size)
        if self.args.warmup:
            await self._warmup()
        if self._stopping:
            return
        self.engine.phase = READY
        self.status("ready", None)
        log.info("front ready on http://%s:%d", self.args.host, self.port)

    def _on_engine_restart(self) -> None:
        asyncio.get_running_loop().create_task(self._rewarm(), name="rewarm")

    async def _rewarm(self) -> None:
        try:
            if self.args.warmup:
                await self._warmup()
        except StartupError as exc:
            log.error("engine restarted but %s", exc)
            self.engine.on_engine_dead(str(exc))
            return
        if not self._stopping and self.engine.phase == STARTING:
            self.engine.phase = READY
            self.status("ready", None)  # the supervisor logs it
            log.info("engine restarted; serving again")

    async def _warmup(self) -> None:
        try:
            result = await run_probe(self.front, 2, WARMUP_TIMEOUT_S)
        except asyncio.TimeoutError as exc:
            raise StartupError(f"warm-up request got no answer in {WARMUP_TIMEOUT_S:.0f} s") from exc
        if result.error is not None:
            raise StartupError(f"warm-up request failed: {result.error}")

    # ------------------------------------------------------------------ shutdown
    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # in-process tests run us in a thread; they call request_stop() instead
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    def request_stop(self) -> None:
        """First signal: drain. A second one (an impatient Ctrl-C) cuts the drain short."""
        if self._stopping:
            self._drain_deadline = 0.0
            return
        self._stopping = True
        loop = asyncio.get_running_loop()
        self._drain_deadline = loop.time() + max(0.0, self.args.shutdown_timeout)
        loop.create_task(self._drain(), name="drain")

    async def _drain(self) -> None:
        engine = self.engine
        if engine.phase != DEAD:
            engine.phase = DRAINING
        while engine.num_inflight and asyncio.get_running_loop().time() < self._drain_deadline:
            await asyncio.sleep(0.05)
        unfinished = engine.num_inflight
        if unfinished:
            log.warning("shutdown: failing %d unfinished requests", unfinished)
        engine.fail_all("server is shutting down", 503, abort_reason="shutdown")
        if engine.phase != DEAD:
            engine.shutdown_engine("front shutting down")
        if unfinished:
            await asyncio.sleep(0.1)  # let handlers write their error responses
        self.server.should_exit = True


def _status_sender(status_conn) -> StatusFn:
    def send(kind: str, detail: str | None) -> None:
        if status_conn is None:
            return
        try:
            status_conn.send((kind, detail))
        except (OSError, EOFError, BrokenPipeError):
            pass  # the supervisor is gone; nothing to tell

    return send


async def _amain(args: ServerArgs, endpoints: Endpoints, status: StatusFn) -> int:
    try:
        server = FrontServer(args, endpoints, status)
        return await server.serve()
    except StartupError as exc:
        log.error("start-up failed: %s", exc)
        status("error", str(exc))
        return 1


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop  # noqa: PLC0415

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


def run(args: ServerArgs, endpoints: Endpoints, status_conn=None) -> None:
    """Process entry point (spawned by the supervisor); exits 0 after a clean shutdown."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    main = _amain(args, endpoints, _status_sender(status_conn))
    if hasattr(asyncio, "Runner"):  # Python 3.11+
        with asyncio.Runner(loop_factory=_new_loop) as runner:
            code = runner.run(main)
    else:
        loop = _new_loop()
        asyncio.set_event_loop(loop)
        code = loop.run_until_complete(main)
        loop.close()
    sys.exit(code)
