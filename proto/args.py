"""ServerArgs: the frozen configuration every process receives, and its command-line parser.

Flags follow SGLang's spelling. A bad value raises ``ArgError`` whose message names the flag;
the CLI prints it as one line and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

BUNDLED_MODEL_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "tiny-shakespeare"
)

SPEC_ALGORITHMS = ("FROZEN-KV-MTP",)
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")
# gpu_worker/quant's methods (kept equal by a unit test; proto imports no process package)
QUANTIZATION_METHODS = ("fp8", "compressed-tensors")
# vLLM's names; "fp8" is an alias of fp8_e4m3
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8")
# vLLM's and SGLang's --dtype also take these torch short names
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# tokenizer_proc/tool_parsers' registry (kept equal by a unit test; proto imports no process package)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "gemma4")
# tokenizer_proc/reasoning.py's registry (kept equal by a unit test); SGLang spells deepseek-r1
REASONING_PARSERS = ("deepseek_r1", "qwen3")


class ArgError(ValueError):
    """A flag value that cannot work; the message starts with the flag's name."""


@dataclass(frozen=True)
class ServerArgs:
    model_path: str
    tokenizer_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    served_model_name: str | None = None
    served_model_aliases: tuple[str, ...] = ()  # further names requests may use (--served-model-name a b)
    page_size: int = 16
    max_running_requests: int | None = None
    max_total_tokens: int | None = None
    chunked_prefill_size: int | None = None
    context_length: int | None = None
    mem_fraction_static: float = 0.85
    load_format: str = "auto"  # auto | dummy
    quantization: str | None = None  # None: the checkpoint's quantization_config; fp8: also online
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | fp8_e4m3 (fp8 is its alias)
    attention_backend: str = "auto"  # auto: triton (else flashinfer) on CUDA; torch on the CPU
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None  # default: min(256, max running requests)
    cuda_graph_bs: tuple[int, ...] | None = None  # explicit bucket list
    disable_piecewise_cuda_graph: bool = False  # prefill steps eager instead of piecewise graphs
    log_level: str = "info"
    num_threads: int | None = None  # worker torch threads on CPU; default all cores but one
    random_seed: int = 0
    tp_size: int = 1  # tensor parallelism: one worker process per rank (GPU)
    disable_overlap_schedule: bool = False
    overlap_depth: int = 3  # steps launched ahead of the last processed result (1 = no overlap)
    disable_prefix_cache: bool = False
    max_queued_requests: int = 4096
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int = 3
    speculative_eagle_topk: int = 1
    speculative_num_draft_tokens: int | None = None
    metrics_compat: str | None = None  # None | vllm
    transport: str = "ipc"  # ipc | tcp
    tcp_base_port: int | None = None
    run_dir: str | None = None
    warmup: bool = True
    # Operations (docs/architecture.md, "Operations").
    shutdown_timeout: float = 30.0
    restart_on_failure: bool = False
    max_engine_restarts: int = 5  # consecutive engine deaths before the supervisor gives up
    api_key: str | None = field(default=None, repr=False)  # or TANDEM_API_KEY
    metrics_require_key: bool = False
    curve_keys_dir: str | None = None  # tcp transport: default = fresh keys in the run dir
    max_request_body_bytes: int = 8 * 1024 * 1024
    # Tool calling (vLLM's flags): parse the model's calls into tool_calls for tool_choice "auto".
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # Chat (vLLM's and SGLang's flags): a template file or inline Jinja; reasoning split.
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    reasoning_parser: str | None = None
    constrained_json_disable_any_whitespace: bool = False  # JSON grammars: fixed separators
    extra: dict = field(default_factory=dict)

    # --------------------------------------------------------------- derived values
    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request's ``model`` may carry; the first is the one responses show."""
        return (self.model_name, *self.served_model_aliases)

    @property
    def tokenizer_dir(self) -> str:
        return self.tokenizer_path or self.model_path

    @property
    def spec_enabled(self) -> bool:
        return self.speculative_algorithm is not None

    @property
    def tokens_per_step(self) -> int:
        if not self.spec_enabled:
            return 1
        return self.speculative_num_draft_tokens or self.speculative_num_steps + 1

    @property
    def overlap(self) -> bool:
        return not self.disable_overlap_schedule and self.overlap_depth > 1

    @property
    def step_depth(self) -> int:
        """Steps the scheduler keeps launched ahead of the results it has processed."""
        return 1 if self.disable_overlap_schedule else self.overlap_depth

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        try:
            import torch  # noqa: PLC0415 - only the worker and CLI resolve devices

            return "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            return "cpu"

    def replace(self, **changes) -> "ServerArgs":
        return dataclasses.replace(self, **changes)


def _positive(flag: str, value: int | None) -> None:
    if value is not None and value <= 0:
        raise ArgError(f"{flag}: must be a positive integer, got {value}")


def validate(args: ServerArgs) -> ServerArgs:
    """Check what can be checked before any process starts. Raises ArgError."""
    if not os.path.isdir(args.model_path):
        raise ArgError(f"--model-path: {args.model_path!r} is not a directory (a local checkpoint; "
                       "hub names are not downloaded)")
    if not os.path.isfile(os.path.join(args.model_path, "config.json")):
        raise ArgError(f"--model-path: no config.json in {args.model_path!r}")
    tok = args.tokenizer_dir
    if not (os.path.isfile(os.path.join(tok, "tokenizer.json"))):
        raise ArgError(f"--tokenizer-path: no tokenizer.json in {tok!r}")
    if not 0 < args.port < 65536:
        raise ArgError(f"--port: must be in 1..65535, got {args.port}")
    dev = args.device
    if dev not in ("auto", "cpu", "cuda") and not (dev.startswith("cuda:") and dev[5:].isdigit()):
        raise ArgError(f"--device: expected auto, cpu, cuda or cuda:N, got {dev!r}")
    if args.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ArgError(f"--dtype: expected auto, float32, bfloat16 or float16, got {args.dtype!r}")
    for flag, val in (
        ("--page-size", args.page_size),
        ("--max-running-requests", args.max_running_requests),
        ("--max-total-tokens", args.max_total_tokens),
        ("--chunked-prefill-size", args.chunked_prefill_size),
        ("--context-length", args.context_length),
        ("--num-threads", args.num_threads),
        ("--max-queued-requests", args.max_queued_requests),
        ("--cuda-graph-max-bs", args.cuda_graph_max_bs),
        ("--max-request-body-bytes", args.max_request_body_bytes),
        ("--tp-size", args.tp_size),
    ):
        _positive(flag, val)
    if args.overlap_depth not in (1, 2, 3):
        raise ArgError(f"--overlap-depth: expected 1, 2 or 3, got {args.overlap_depth}")
    if not 0.0 < args.mem_fraction_static <= 1.0:  # vLLM's --gpu-memory-utilization takes 1.0 too
        raise ArgError(f"--mem-fraction-static (--gpu-memory-utilization): must be in (0, 1], "
                       f"got {args.mem_fraction_static}")
    if args.load_format not in ("auto", "dummy"):
        raise ArgError(f"--load-format: expected auto or dummy, got {args.load_format!r}")
    if args.quantization is not None and args.quantization not in QUANTIZATION_METHODS:
        raise ArgError(f"--quantization: {args.quantization!r} is not supported "
                       f"(one of {', '.join(QUANTIZATION_METHODS)})")
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ArgError(f"--kv-cache-dtype: expected one of {', '.join(KV_CACHE_DTYPES)}, got {args.kv_cache_dtype!r}")
    if args.attention_backend not in ATTENTION_BACKENDS:
        raise ArgError(
            f"--attention-backend: expected one of {', '.join(ATTENTION_BACKENDS)}, "
            f"got {args.attention_backend!r}"
        )
    if args.cuda_graph_bs is not None and (not args.cuda_graph_bs or min(args.cuda_graph_bs) <= 0):
        raise ArgError(f"--cuda-graph-bs: expected positive batch sizes, got {list(args.cuda_graph_bs or ())}")
    if args.attention_backend == "flashinfer" and args.device == "cpu":
        raise ArgError("--attention-backend flashinfer: needs a CUDA device (use triton or torch with --device cpu)")
    if args.log_level not in LOG_LEVELS:
        raise ArgError(f"--log-level: expected one of {', '.join(LOG_LEVELS)}, got {args.log_level!r}")
    if args.metrics_compat not in (None, "vllm"):
        raise ArgError(f"--metrics-compat: expected vllm, got {args.metrics_compat!r}")
    if args.transport not in ("ipc", "tcp"):
        raise ArgError(f"--transport: expected ipc or tcp, got {args.transport!r}")
    _validate_ops(args)
    _validate_spec(args)
    _validate_tools(args)
    _validate_chat(args)
    return args


def _validate_chat(args: ServerArgs) -> None:
    if args.reasoning_parser is not None and args.reasoning_parser not in REASONING_PARSERS:
        raise ArgError(f"--reasoning-parser: expected one of {', '.join(REASONING_PARSERS)}, "
                       f"got {args.reasoning_parser!r}")
    if args.chat_template is None:
        return
    from proto.jinja_env import compile_template, read_template_source  # noqa: PLC0415 - jinja2 only when asked

    try:
        compile_template(read_template_source(args.chat_template))
    except ValueError as exc:
        raise ArgError(f"--chat-template: {exc}") from None


def _validate_tools(args: ServerArgs) -> None:
    if args.tool_call_parser is not None and args.tool_call_parser not in TOOL_CALL_PARSERS:
        raise ArgError(f"--tool-call-parser: expected one of {', '.join(TOOL_CALL_PARSERS)}, "
                       f"got {args.tool_call_parser!r}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ArgError("--enable-auto-tool-choice: requires --tool-call-parser "
                       f"(one of {', '.join(TOOL_CALL_PARSERS)})")


def _validate_ops(args: ServerArgs) -> None:
    if args.shutdown_timeout < 0:
        raise ArgError(f"--shutdown-timeout: must be >= 0 seconds, got {args.shutdown_timeout}")
    if args.max_engine_restarts < 0:
        raise ArgError(f"--max-engine-restarts: must be >= 0, got {args.max_engine_restarts}")
    if args.api_key is not None and not args.api_key.strip():
        raise ArgError("--api-key: must not be empty (leave it out to serve without a key)")
    if args.metrics_require_key and args.api_key is None:
        raise ArgError("--metrics-require-key: needs --api-key (or TANDEM_API_KEY)")
    if args.curve_keys_dir is not None:
        if args.transport != "tcp":
            raise ArgError("--curve-keys-dir: only used with --transport tcp")
        from proto.curve import CurveKeyError, load_keys  # noqa: PLC0415 - zmq only when asked

        try:
            load_keys(args.curve_keys_dir)
        except CurveKeyError as exc:
            raise ArgError(f"--curve-keys-dir: {exc}") from None


def _validate_spec(args: ServerArgs) -> None:
    if args.speculative_algorithm is None:
        return
    if args.speculative_algorithm not in SPEC_ALGORITHMS:
        raise ArgError(
            f"--speculative-algorithm: expected one of {', '.join(SPEC_ALGORITHMS)}, "
            f"got {args.speculative_algorithm!r}"
        )
    draft = args.speculative_draft_model_path
    if not draft:
        raise ArgError("--speculative-draft-model-path: required with --speculative-algorithm")
    if not os.path.isfile(os.path.join(draft, "config.json")):
        raise ArgError(f"--speculative-draft-model-path: no config.json in {draft!r}")
    if not 1 <= args.speculative_num_steps <= 16:
        raise ArgError(f"--speculative-num-steps: must be in 1..16, got {args.speculative_num_steps}")
    if args.speculative_eagle_topk != 1:
        raise ArgError(
            f"--speculative-eagle-topk: only 1 (a draft chain) is supported, got {args.speculative_eagle_topk}"
        )
    n = args.speculative_num_draft_tokens
    if n is not None and n != args.speculative_num_steps + 1:
        raise ArgError(
            f"--speculative-num-draft-tokens: with topk 1 it must equal --speculative-num-steps + 1 "
            f"({args.speculative_num_steps + 1}), got {n}"
        )


def build_parser() -> argparse.ArgumentParser:
    from proto.serve_flags import build_parser as build  # noqa: PLC0415 - serve_flags imports this module

    return build()


def parse_server_args(argv: list[str]) -> ServerArgs:
    """Parse and validate; with no --model-path, serve the bundled tiny pair with MTP on."""
    ns = build_parser().parse_args(argv)
    kw = {k: v for k, v in vars(ns).items() if k not in ("skip_warmup", "model_tag")}
    kw["warmup"] = not ns.skip_warmup
    kw["model_path"] = _model_path(ns.model_tag, ns.model_path)
    if kw["reasoning_parser"]:  # SGLang's names use '-' (deepseek-r1), vLLM's '_'
        kw["reasoning_parser"] = kw["reasoning_parser"].replace("-", "_")
    kw["dtype"] = DTYPE_ALIASES.get(kw["dtype"], kw["dtype"])
    kw["kv_cache_dtype"] = "fp8_e4m3" if kw["kv_cache_dtype"] == "fp8" else kw["kv_cache_dtype"]
    kw["cuda_graph_bs"] = tuple(kw["cuda_graph_bs"]) if kw["cuda_graph_bs"] else None
    names = kw.pop("served_model_name") or [None]
    kw["served_model_name"], kw["served_model_aliases"] = names[0], tuple(n for n in dict.fromkeys(names[1:]) if n != names[0])
    if kw["api_key"] is None and os.environ.get("TANDEM_API_KEY"):
        kw["api_key"] = os.environ["TANDEM_API_KEY"]
    if kw["model_path"] is None:
        kw.update(bundled_model_defaults(kw))
    kw["speculative_algorithm"] = (kw["speculative_algorithm"] or None) and kw["speculative_algorithm"].upper()
    return validate(ServerArgs(**kw))


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
