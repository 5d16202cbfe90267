"""ServerArgs: the frozen configuration every process receives, each field declared once with
its flags (``common.flags``): ``tandem serve``'s parser is built from these fields.

Flags follow SGLang's spelling; vLLM's spellings for the same setting are further names of the
flag (shown next to it in ``--help``). An alias is listed only where the meaning matches; where
the two engines differ in a detail the help says how. A bad value raises ``ArgError`` whose
message names the flag; the CLI prints it as one line and exits 2.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from common.flags import ArgError, opt, token_count
from common.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS

__all__ = ["ArgError", "BUNDLED_MODEL_DIR", "ServerArgs"]

BUNDLED_MODEL_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "tiny-shakespeare"
)

SPEC_ALGORITHMS = ("FROZEN-KV-MTP",)
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")
DTYPES = ("auto", "bfloat16", "float16", "float32")
# vLLM's and SGLang's --dtype also take these torch short names
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# gpu_worker/quant's methods (a unit test keeps them equal; common/ imports no process package)
QUANTIZATION_METHODS = ("fp8", "compressed-tensors")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # vLLM's names; fp8 is an alias of fp8_e4m3
MODEL, SERVER, ENGINE, PARALLEL, SPEC, OPS, CHAT = (
    "model", "server", "engine", "parallelism", "speculative decoding", "operations",
    "chat: templates, tool calls, reasoning")


def _dtype(value: str) -> str:
    return DTYPE_ALIASES.get(value, value)


def _kv_cache_dtype(value: str) -> str:
    return "fp8_e4m3" if value == "fp8" else value


def _reasoning_name(value: str) -> str:
    return value.replace("-", "_")  # SGLang's names use '-' (deepseek-r1), vLLM's '_'


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = opt(None, "--model-path", "--model", group=MODEL, metavar="DIR|HUB_ID",
                          default_text="the bundled tiny-shakespeare pair, with MTP",
                          help="the checkpoint: a local HF directory, or a Hugging Face Hub id (downloaded once "
                          "into the HF cache; a local directory of that name wins)")
    tokenizer_path: str | None = opt(None, "--tokenizer-path", "--tokenizer", group=MODEL, metavar="DIR|HUB_ID",
                                     default_text="the model's", help="where tokenizer.json is")
    revision: str | None = opt(None, "--revision", group=MODEL, metavar="REV", default_text="main",
                               help="the Hub branch, tag or commit of a Hub id (every path resolved from the Hub)")
    download_dir: str | None = opt(None, "--download-dir", group=MODEL, metavar="DIR",
                                   default_text="the HF cache: $HF_HOME/hub",
                                   help="where Hub checkpoints are downloaded and looked up")
    dtype: str = opt("auto", "--dtype", group=MODEL, parse=_dtype, choices=DTYPES, metavar="DTYPE",
                     help="weights and activations (half = float16, float = float32); "
                     "auto: bfloat16 on CUDA, float32 on the CPU")
    load_format: str = opt("auto", "--load-format", group=MODEL, choices=("auto", "dummy"), metavar="FORMAT",
                           help="dummy: random weights of the checkpoint's shapes (config.json only)")
    quantization: str | None = opt(
        None, "--quantization", "-q", group=MODEL, choices=QUANTIZATION_METHODS, metavar="METHOD",
        default_text="the checkpoint's quantization_config",
        help="fp8: FP8 weights; an unquantized checkpoint (the draft model too, MoE experts too) is quantized at "
        "load, one scale per output channel, activations quantized dynamically (experts' stay unquantized). "
        "compressed-tensors: the checkpoint's own. "
        "Checkpoints: 'fp8' (128x128 blocks or per tensor) and 'compressed-tensors' float8; any other "
        "quantization_config is refused at start")
    served_model_name: str | None = opt(None, "--served-model-name", group=MODEL, metavar="NAME", nargs="+",
                                        default_text="the model path or Hub id",
                                        help="the model name(s) requests may use; responses and metrics carry "
                                        "the first (as in vLLM)")
    served_model_aliases: tuple[str, ...] = ()  # the further names of --served-model-name a b
    random_seed: int = opt(0, "--random-seed", "--seed", group=MODEL, metavar="N",
                           help="seeds the worker's RNG (dummy weights) and the seeds drawn for requests without "
                           "one: restarted with the same N, the same requests in the same order sample the same "
                           "tokens, whatever the batching; a request's own `seed` always wins")
    host: str = opt("127.0.0.1", "--host", group=SERVER, metavar="ADDR", help="the HTTP address to listen on")
    port: int = opt(8000, "--port", group=SERVER, metavar="PORT", help="the HTTP port")
    log_level: str = opt("info", "--log-level", group=SERVER, choices=LOG_LEVELS, metavar="LEVEL",
                         help="every process's log level")
    device: str = opt("auto", "--device", group=ENGINE, metavar="{auto,cpu,cuda,cuda:N}",
                      help="where the model runs; auto: CUDA when a GPU is visible, else the CPU")
    page_size: int = opt(16, "--page-size", "--block-size", group=ENGINE, metavar="N", positive=True,
                         help="tokens per KV-cache page")
    max_running_requests: int | None = opt(None, "--max-running-requests", "--max-num-seqs", group=ENGINE,
                                           metavar="N", positive=True, default_text="256 on CUDA, 8 on the CPU",
                                           help="requests (choices) decoded together at most")
    max_total_tokens: int | None = opt(None, "--max-total-tokens", group=ENGINE, metavar="N", positive=True,
                                       default_text="from memory", help="KV-cache size in tokens")
    chunked_prefill_size: int | None = opt(
        None, "--chunked-prefill-size", "--max-num-batched-tokens", group=ENGINE, metavar="N", parse=token_count,
        positive=True, default_text="8192 on CUDA, 2048 on the CPU",
        help="token budget of one engine step: decode rows first (1 token each, 1 + draft tokens with MTP), "
        "then prefill chunks")
    context_length: int | None = opt(
        None, "--context-length", "--max-model-len", group=ENGINE, metavar="N", parse=token_count, positive=True,
        default_text="the model's max_position_embeddings, capped by the KV cache",
        help="longest prompt + completion; vLLM's 32k (32000) and 32K (32768) forms work too. Past the "
        "model's max_position_embeddings only with --allow-long-context-length")
    allow_long_context_length: bool = opt(
        False, "--allow-long-context-length", group=ENGINE,
        help="accept a --context-length past the model's max_position_embeddings (vLLM's "
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN): positions the model never saw in training may give poor output")
    mem_fraction_static: float = opt(
        0.85, "--mem-fraction-static", "--gpu-memory-utilization", group=ENGINE, metavar="F",
        help="share of the GPU's total memory for weights + KV cache + activations (vLLM's default is 0.9). "
        "Unlike vLLM, memory other processes hold on the GPU counts against it, and activations are a "
        "fixed reserve, not profiled")
    kv_cache_dtype: str = opt("auto", "--kv-cache-dtype", group=ENGINE, parse=_kv_cache_dtype, choices=KV_CACHE_DTYPES,
                              metavar="DTYPE",
                              help="auto: the model dtype; fp8_e4m3 (or fp8): float8 e4m3, twice the tokens in the "
                              "same memory, scaled by the checkpoint's per-layer k / v scales, else 1.0")
    attention_backend: str = opt("auto", "--attention-backend", group=ENGINE, choices=ATTENTION_BACKENDS,
                                 metavar="NAME",
                                 help="auto: triton (else flashinfer) on CUDA, torch on the CPU")
    disable_cuda_graph: bool = opt(False, "--disable-cuda-graph", "--enforce-eager", group=ENGINE,
                                   help="run every step eagerly: no CUDA graphs on the GPU, no compiled decode "
                                   "steps on the CPU")
    cuda_graph_max_bs: int | None = opt(None, "--cuda-graph-max-bs", group=ENGINE, metavar="N", positive=True,
                                        default_text="min(256, --max-running-requests)",
                                        help="largest decode batch captured")
    cuda_graph_bs: tuple[int, ...] | None = opt(None, "--cuda-graph-bs", group=ENGINE, metavar="N", nargs="+",
                                                default_text="1, 2, 4, 8, 12, 16, 24 ... 256, capped at --cuda-graph-max-bs",
                                                help="decode batch sizes to capture")
    disable_piecewise_cuda_graph: bool = opt(
        False, "--disable-piecewise-cuda-graph", group=ENGINE,
        help="run prefill steps eagerly (otherwise piecewise graphs per token bucket, attention eager)")
    num_threads: int | None = opt(None, "--num-threads", group=ENGINE, metavar="N", positive=True,
                                  default_text="all cores but one",
                                  help="worker CPU threads (where the default is one, the compiled CPU steps' own GEMMs "
                                  "also use the other core while it is idle)")
    disable_overlap_schedule: bool = opt(False, "--disable-overlap-schedule", group=ENGINE,
                                         help="plan each step after the previous one's result (= --overlap-depth 1)")
    overlap_depth: int = opt(3, "--overlap-depth", group=ENGINE, metavar="N", choices=(1, 2, 3),
                             help="steps launched ahead of the last processed result: 3 keeps the scheduler's "
                             "round trip out of the step cycle where the host, not the GPU, bounds a step (small "
                             "models, MTP); 2 plans step N+1 while N runs; 1 = --disable-overlap-schedule")
    disable_prefix_cache: bool = opt(False, "--disable-prefix-cache", "--disable-radix-cache",
                                     "--no-enable-prefix-caching", group=ENGINE, off=("--enable-prefix-caching",),
                                     help="no prefix (radix) cache")
    max_queued_requests: int = opt(4096, "--max-queued-requests", group=ENGINE, metavar="N", positive=True,
                                   help="waiting (not yet running) requests beyond which new ones get 503 + "
                                   "Retry-After")
    warmup: bool = opt(True, "--skip-warmup", "--skip-server-warmup", group=ENGINE, invert=True,
                       help="report ready without sending a warm-up request round the engine first")
    tp_size: int = opt(1, "--tp-size", "--tensor-parallel-size", "--tp", "-tp", group=PARALLEL, metavar="N",
                       positive=True, help="tensor parallelism: shard the models over this many GPUs, one worker "
                       "process each")
    dp_size: int = opt(1, "--dp-size", "--data-parallel-size", "--dp", "-dp", group=PARALLEL, metavar="N", positive=True,
                       help="data parallelism: N engines (CUDA: one GPU each; CPU: sharing the cores) behind a "
                       "cache-aware router on --port; 1 is a single engine, no router")
    dp_base_port: int | None = opt(None, "--dp-base-port", group=PARALLEL, metavar="PORT",
                                   default_text="--port + 1",
                                   help="with --dp-size N: engine i listens on 127.0.0.1:PORT+i (its /metrics "
                                   "too; the router's /metrics carries every engine's series, labelled "
                                   "engine=127.0.0.1:PORT+i)")
    speculative_algorithm: str | None = opt(None, "--speculative-algorithm", group=SPEC, metavar="NAME",
                                            parse=str.upper, choices=SPEC_ALGORITHMS,
                                            default_text="none (FROZEN-KV-MTP for the bundled pair)",
                                            help="speculative decoding with a draft model")
    speculative_draft_model_path: str | None = opt(None, "--speculative-draft-model-path", group=SPEC,
                                                   metavar="DIR|HUB_ID", help="the draft (assistant) checkpoint")
    speculative_num_steps: int = opt(3, "--speculative-num-steps", group=SPEC, metavar="N",
                                     help="draft tokens per step (1..16)")
    speculative_eagle_topk: int = opt(1, "--speculative-eagle-topk", group=SPEC, metavar="N",
                                      help="draft branches per step (only 1, a chain)")
    speculative_num_draft_tokens: int | None = opt(None, "--speculative-num-draft-tokens", group=SPEC, metavar="N",
                                                   default_text="--speculative-num-steps + 1",
                                                   help="tokens verified per step")
    metrics_compat: str | None = opt(None, "--metrics-compat", group=OPS, choices=("vllm",), metavar="NAME",
                                     help="also export /metrics under vLLM's names")
    transport: str = opt("ipc", "--transport", group=OPS, choices=("ipc", "tcp"), metavar="NAME",
                         help="the engine's internal channels: unix sockets in the run dir, or tcp (CURVE-encrypted)")
    tcp_base_port: int | None = opt(None, "--tcp-base-port", group=OPS, metavar="PORT", default_text="--port + 1",
                                    help="--transport tcp: the first of the four channel ports")
    run_dir: str | None = opt(None, "--run-dir", group=OPS, metavar="DIR", default_text="a fresh temporary dir",
                              help="where the engine's sockets live (0700)")
    shutdown_timeout: float = opt(30.0, "--shutdown-timeout", group=OPS, metavar="S",
                                  help="on SIGTERM, seconds running and queued requests get to finish")
    restart_on_failure: bool = opt(False, "--restart-on-failure", group=OPS,
                                   help="restart the engine (scheduler + worker) when one of them dies, instead "
                                   "of exiting")
    max_engine_restarts: int = opt(5, "--max-engine-restarts", group=OPS, metavar="N",
                                   help="with --restart-on-failure: give up (exit 1) after this many consecutive "
                                   "engine deaths")
    api_key: str | None = opt(None, "--api-key", group=OPS, metavar="KEY", secret=True,
                              default_text="none, or $TANDEM_API_KEY",
                              help="require 'Authorization: Bearer KEY' on the API")
    metrics_require_key: bool = opt(False, "--metrics-require-key", group=OPS,
                                    help="require the API key on /health, /metrics, /load too")
    curve_keys_dir: str | None = opt(None, "--curve-keys-dir", group=OPS, metavar="DIR",
                                     default_text="fresh keys per run",
                                     help="--transport tcp: CURVE keys from 'tandem keys generate DIR'")
    max_request_body_bytes: int = opt(8 * 1024 * 1024, "--max-request-body-bytes", group=OPS, metavar="N",
                                      positive=True, default_text="8 MiB", help="larger request bodies get 413")
    chat_template: str | None = opt(None, "--chat-template", group=CHAT, metavar="FILE|JINJA",
                                    default_text="the tokenizer's",
                                    help="a Jinja chat template file, or the template itself (text with '{', '}' "
                                    "or a newline)")
    trust_request_chat_template: bool = opt(False, "--trust-request-chat-template", group=CHAT,
                                            help="let requests bring their own template (the chat_template "
                                            "field); refused with 400 otherwise")
    enable_auto_tool_choice: bool = opt(False, "--enable-auto-tool-choice", group=CHAT,
                                        help="answer tool_choice 'auto' (the default with tools) with parsed "
                                        "tool_calls; needs --tool-call-parser")
    tool_call_parser: str | None = opt(None, "--tool-call-parser", group=CHAT, metavar="NAME",
                                       choices=tuple(TOOL_CALL_PARSERS), help="how the model writes tool calls")
    reasoning_parser: str | None = opt(None, "--reasoning-parser", group=CHAT, metavar="NAME",
                                       parse=_reasoning_name, choices=tuple(REASONING_PARSERS),
                                       help="split <think> reasoning out of chat answers into reasoning_content")
    constrained_json_disable_any_whitespace: bool = opt(
        False, "--constrained-json-disable-any-whitespace", group=CHAT,
        help="JSON-schema outputs (response_format, tool_choice required / named) use fixed separators instead "
        "of allowing any whitespace between tokens, for models that run away on whitespace (vLLM's "
        "disable_any_whitespace)")

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
        """``auto`` made concrete: cuda when ``common.devices`` finds a usable GPU (a CUDA build
        of torch and a driver that counts one), else cpu; found without importing torch."""
        if self.device != "auto":
            return self.device
        from common.devices import cuda_devices  # noqa: PLC0415 - loads the NVIDIA driver only when asked

        return "cuda" if cuda_devices().count else "cpu"

    def replace(self, **changes) -> "ServerArgs":
        return dataclasses.replace(self, **changes)

