"""The ``tandem serve`` command line: argparse built from ServerArgs' field declarations, the
positional MODEL (``vllm serve MODEL``'s habit), and the vLLM and SGLang flags that mean nothing
here or cannot work (each accepted with its meaning in ``--help``, or refused with one line saying why).

``parse_server_args`` is argv -> checked values -> Hub ids resolved (``common.hub``) ->
validated ServerArgs (``prepare_server_args``, the same for a ServerArgs built in Python); with
no model it serves the bundled tiny pair with MTP on.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Callable

from common.args import BUNDLED_MODEL_DIR, PARALLEL, ServerArgs
from common.flags import ArgError, Parser, add_flags, formatter, given_values
from common.hub import resolve_model_paths
from common.validate import check_values, validate

USAGE = "tandem serve [MODEL] [--model-path DIR|HUB_ID] [options]"
GROUPS = {PARALLEL: "With --dp-size N > 1, every --router-<flag> V is passed to the router as --<flag> V "
                    "(e.g. --router-policy round_robin); see `tandem router --help`."}


@dataclass(frozen=True)
class Habit:
    """A vLLM or SGLang flag users pass by habit that has no setting of its own here."""
    names: tuple[str, ...]
    help: str
    metavar: str | None = None  # None: a switch
    refuse: Callable[[str | None], str | None] = lambda value: None  # why it cannot work, else None


def _pp(value: str | None) -> str | None:
    if value is not None and value.strip() != "1":
        return f"only 1 is supported, got {value} (no pipeline parallelism here; --tp-size shards over GPUs)"
    return None


HABITS = (
    Habit(("--enable-chunked-prefill",), "accepted, no effect: prefill is always chunked (--chunked-prefill-size)"),
    Habit(("--disable-log-requests",), "accepted, no effect: requests are never logged one by one"),
    Habit(("--enable-metrics",), "accepted, no effect: /metrics is always on (SGLang's switch)"),
    Habit(("--pipeline-parallel-size", "-pp", "--pp-size"), "accepted as 1 only (no pipeline parallelism; see --tp-size)",
          metavar="1", refuse=_pp),
    Habit(("--trust-remote-code",), "refused: no checkpoint code is ever run; Tandem serves the architectures it "
          "implements itself", refuse=lambda value: "no checkpoint code is ever run here: Tandem implements each "
          "architecture it serves itself; leave the flag out"),
)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="tandem serve", usage=USAGE, formatter_class=formatter,
               description="Serve a model over an OpenAI-compatible API. Flags use SGLang's names; "
               "vLLM's names for the same settings are accepted too (listed after a comma).")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the checkpoint directory or Hub id, as in `vllm serve MODEL` (same as --model-path)")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    add_flags(p, ServerArgs, GROUPS)
    habits = p.add_argument_group("vLLM and SGLang flags with no setting here")
    for h in HABITS:
        dest = "habit__" + h.names[0].lstrip("-").replace("-", "_")
        if h.metavar is None:
            habits.add_argument(*h.names, dest=dest, action="store_const", const="", help=h.help)
        else:
            habits.add_argument(*h.names, dest=dest, metavar=h.metavar, help=h.help)
    return p


def parse_server_args(argv: list[str]) -> ServerArgs:
    """Parse, resolve Hub ids and validate; raises ArgError (one line naming the flag)."""
    return prepare_server_args(args_from_argv(argv))


def prepare_server_args(args: ServerArgs) -> ServerArgs:
    """What ``tandem serve`` does with its ServerArgs before any process starts, for callers that
    build one in Python (``tandem.LLM``): check the values, resolve Hub ids, validate."""
    return validate(resolve_model_paths(check_values(args)))


def args_from_argv(argv: list[str]) -> ServerArgs:
    """The ServerArgs argv asks for, unchecked: no file is read and nothing is downloaded."""
    ns = build_parser().parse_args(argv)
    for h in HABITS:
        value = getattr(ns, "habit__" + h.names[0].lstrip("-").replace("-", "_"), None)
        why = None if value is None else h.refuse(value or None)
        if why is not None:
            raise ArgError(f"{h.names[0]}: {why}")
    kw = given_values(ServerArgs, ns)
    kw["model_path"] = _model_path(ns.model_tag, kw.get("model_path"))
    names = kw.pop("served_model_name", None) or (None,)
    kw["served_model_name"] = names[0]
    kw["served_model_aliases"] = tuple(n for n in dict.fromkeys(names[1:]) if n != names[0])
    if kw.get("api_key") is None and os.environ.get("TANDEM_API_KEY"):
        kw["api_key"] = os.environ["TANDEM_API_KEY"]
    if kw["model_path"] is None:
        kw.update(bundled_model_defaults(kw))
    return ServerArgs(**kw)


def _model_path(positional: str | None, flag: str | None) -> str | None:
    """vLLM's ``serve MODEL`` and ``--model``/``--model-path`` name one thing: both only if equal."""
    if positional is not None and flag is not None and positional != flag:
        raise ArgError(f"--model-path: {flag!r} differs from the positional MODEL {positional!r} (give one)")
    return positional if positional is not None else flag


def bundled_model_defaults(kw: dict) -> dict:
    target = os.path.join(BUNDLED_MODEL_DIR, "target")
    assistant = os.path.join(BUNDLED_MODEL_DIR, "assistant")
    out: dict = {"model_path": target, "served_model_name": kw.get("served_model_name") or "tiny-shakespeare"}
    if kw.get("speculative_algorithm") is None and os.path.isdir(assistant):
        out["speculative_algorithm"] = "FROZEN-KV-MTP"
        out["speculative_draft_model_path"] = kw.get("speculative_draft_model_path") or assistant
    return out
