"""The ``tandem serve`` command line: every flag, its SGLang spelling first, then the vLLM
spellings that mean the same thing (shown next to it in ``--help``).

An alias is listed only where the meaning matches; where the two engines differ in a detail the
help text says how. ``proto.args.parse_server_args`` turns the parsed namespace into ServerArgs.
"""

from __future__ import annotations

import argparse

from proto.args import REASONING_PARSERS, TOOL_CALL_PARSERS, ArgError

USAGE = "tandem serve [MODEL] [--model-path DIR] [options]"


class _Parser(argparse.ArgumentParser):
    """argparse that raises ArgError instead of printing usage and exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise ArgError(message)


_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def token_count(value: str) -> int:
    """An integer, or vLLM's human-readable form for token counts: 32k = 32000, 32K = 32768,
    25.6k = 25600 (decimals only with the decimal suffixes k/m/g/t)."""
    text = value.strip()
    try:
        return int(text)
    except ValueError:
        pass
    number, suffix = text[:-1], text[-1:]
    if suffix in _DECIMAL and number.replace(".", "", 1).isdigit():
        return int(float(number) * _DECIMAL[suffix])
    if suffix in _BINARY and number.isdigit():
        return int(number) * _BINARY[suffix]
    raise argparse.ArgumentTypeError(f"invalid token count {value!r} (an integer, or e.g. 32k = 32000, 32K = 32768)")


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(prog, max_help_position=34, width=100)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tandem serve", usage=USAGE, formatter_class=_formatter,
                description="Serve a model over an OpenAI-compatible API. Flags use SGLang's names; "
                "vLLM's names for the same settings are accepted too (listed after a comma).")
    _model_flags(p)
    _engine_flags(p)
    _spec_flags(p)
    _ops_flags(p.add_argument_group("operations"))
    _chat_flags(p.add_argument_group("chat: templates, tool calls, reasoning"))
    return p


def _model_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("model_tag", nargs="?", default=None, metavar="MODEL",
      help="the checkpoint directory, as in `vllm serve MODEL` (same as --model-path; put it first)")
    a("--model-path", "--model", metavar="DIR", default=None,
      help="HF checkpoint directory (default: the bundled pair)")
    a("--tokenizer-path", "--tokenizer", metavar="DIR", default=None,
      help="directory with tokenizer.json (default: the model's)")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=8000)
    a("--device", default="auto")
    a("--dtype", default="auto", help="auto, bfloat16, float16 (half), float32 (float)")
    a("--served-model-name", metavar="NAME", nargs="+", default=None,
      help="the model name(s) requests may use; responses and metrics carry the first (as in vLLM)")
    a("--load-format", default="auto")
    a("--random-seed", "--seed", metavar="N", type=int, default=0,
      help="seeds the worker's RNG (dummy weights) and the seeds drawn for requests without one: "
      "restarted with the same N, the same requests in the same order sample the same tokens, "
      "whatever the batching; a request's own `seed` always wins")
    a("--log-level", default="info")


def _engine_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--page-size", "--block-size", metavar="N", type=int, default=16, help="tokens per KV-cache page")
    a("--max-running-requests", "--max-num-seqs", metavar="N", type=int, default=None,
      help="requests (choices) decoded together at most")
    a("--max-total-tokens", metavar="N", type=int, default=None, help="KV-cache size in tokens (default: from memory)")
    a("--chunked-prefill-size", "--max-num-batched-tokens", metavar="N", type=token_count, default=None,
      help="token budget of one engine step: decode rows first (1 token each, 1 + draft tokens with MTP), "
      "then prefill chunks (default 8192 on GPU, 2048 on CPU)")
    a("--context-length", "--max-model-len", metavar="N", type=token_count, default=None,
      help="longest prompt + completion (default: the model's, capped by the KV cache); "
      "vLLM's 32k (32000) and 32K (32768) forms work too")
    a("--mem-fraction-static", "--gpu-memory-utilization", metavar="F", type=float, default=0.85,
      help="share of the GPU's total memory for weights + KV cache + activations (default 0.85; vLLM's "
      "is 0.9). Unlike vLLM, memory other processes hold on the GPU counts against it, and activations "
      "are a fixed reserve, not profiled")
    a("--attention-backend", default="auto", help="auto (triton, else flashinfer, on CUDA; torch on the CPU), "
      "torch, triton, flashinfer")
    a("--disable-cuda-graph", "--enforce-eager", action="store_true",
      help="run every step eagerly: no CUDA graphs on the GPU, no compiled decode steps on the CPU")
    a("--disable-piecewise-cuda-graph", action="store_true",
      help="run prefill steps eagerly (default: piecewise graphs per token bucket, attention eager)")
    a("--cuda-graph-max-bs", metavar="N", type=int, default=None, help="largest decode batch captured (default 256)")
    a("--cuda-graph-bs", metavar="N", type=int, nargs="+", default=None, help="decode batch sizes to capture")
    a("--num-threads", metavar="N", type=int, default=None, help="worker CPU threads (default: all cores but one)")
    a("--tp-size", "--tensor-parallel-size", "--tp", "-tp", metavar="N", dest="tp_size", type=int, default=1,
      help="tensor parallelism: shard the models over this many GPUs, one worker process each")
    a("--disable-overlap-schedule", action="store_true")
    a("--overlap-depth", metavar="N", type=int, default=3,
      help="steps launched ahead of the last processed result: 3 (default) keeps the scheduler's round "
      "trip out of the step cycle where the host, not the GPU, bounds a step (small models, MTP); "
      "2 plans step N+1 while N runs; 1 = --disable-overlap-schedule")
    a("--disable-prefix-cache", "--disable-radix-cache", "--no-enable-prefix-caching", action="store_true",
      default=False, help="no prefix (radix) cache")
    a("--enable-prefix-caching", dest="disable_prefix_cache", action="store_false", default=False,
      help="the default (vLLM's spelling); undoes an earlier --disable-prefix-cache")
    a("--max-queued-requests", metavar="N", type=int, default=4096,
      help="waiting (not yet running) requests beyond which new ones get 503 + Retry-After")
    a("--metrics-compat", default=None)
    a("--transport", default="ipc")
    a("--tcp-base-port", metavar="PORT", type=int, default=None)
    a("--run-dir", metavar="DIR", default=None)
    a("--skip-warmup", action="store_true")


def _spec_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--speculative-algorithm", metavar="NAME", default=None, help="FROZEN-KV-MTP")
    a("--speculative-draft-model-path", metavar="DIR", default=None)
    a("--speculative-num-steps", metavar="N", type=int, default=3)
    a("--speculative-eagle-topk", metavar="N", type=int, default=1)
    a("--speculative-num-draft-tokens", metavar="N", type=int, default=None)


def _ops_flags(ops: argparse._ArgumentGroup) -> None:
    o = ops.add_argument
    o("--shutdown-timeout", metavar="S", type=float, default=30.0,
      help="on SIGTERM, seconds running and queued requests get to finish (default 30)")
    o("--restart-on-failure", action="store_true",
      help="restart the engine (scheduler + worker) when one of them dies, instead of exiting")
    o("--max-engine-restarts", metavar="N", type=int, default=5,
      help="with --restart-on-failure: give up (exit 1) after this many consecutive engine deaths")
    o("--api-key", metavar="KEY", default=None,
      help="require 'Authorization: Bearer KEY' on the API (or set TANDEM_API_KEY)")
    o("--metrics-require-key", action="store_true", help="require the API key on /health, /metrics, /load too")
    o("--curve-keys-dir", metavar="DIR", default=None,
      help="--transport tcp: CURVE keys from 'tandem keys generate DIR' (default: fresh keys per run)")
    o("--max-request-body-bytes", metavar="N", type=int, default=8 * 1024 * 1024,
      help="larger request bodies get 413 (default 8 MiB)")


def _chat_flags(chat: argparse._ArgumentGroup) -> None:
    c = chat.add_argument
    c("--chat-template", metavar="FILE|JINJA", default=None,
      help="a Jinja chat template file, or the template itself (text with '{', '}' or a newline), "
      "used instead of the tokenizer's")
    c("--trust-request-chat-template", action="store_true",
      help="let requests bring their own template (the chat_template field); refused with 400 otherwise")
    c("--enable-auto-tool-choice", action="store_true",
      help="answer tool_choice 'auto' (the default with tools) with parsed tool_calls; needs --tool-call-parser")
    c("--tool-call-parser", metavar="NAME", default=None,
      help=f"how the model writes tool calls: {', '.join(TOOL_CALL_PARSERS)}")
    c("--reasoning-parser", metavar="NAME", default=None,
      help=f"split <think> reasoning out of chat answers into reasoning_content: {', '.join(REASONING_PARSERS)}")
    c("--constrained-json-disable-any-whitespace", action="store_true",
      help="JSON-schema outputs (response_format, tool_choice required / named) use fixed separators instead "
      "of allowing any whitespace between tokens, for models that run away on whitespace (vLLM's "
      "disable_any_whitespace)")
