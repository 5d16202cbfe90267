"""What can be checked of a ServerArgs before any process starts: each problem is one
``ArgError`` line naming the flag. ``check_values`` needs nothing but the values;
``validate`` also reads the checkpoints (so it runs after ``common.hub.resolve_model_paths``)
and the chat template."""

from __future__ import annotations

import os

from common.args import ServerArgs
from common.flags import ArgError, check_numbers
from common.hf_files import read_json
from common.parsers import TOOL_CALL_PARSERS


def check_values(args: ServerArgs) -> ServerArgs:
    """Ranges, choices and flags that need each other; no file is read."""
    check_numbers(args)  # every `positive` and `choices` of the field declarations
    if not 0 < args.port < 65536:
        raise ArgError(f"--port: must be in 1..65535, got {args.port}")
    dev = args.device
    if dev not in ("auto", "cpu", "cuda") and not (dev.startswith("cuda:") and dev[5:].isdigit()):
        raise ArgError(f"--device: expected auto, cpu, cuda or cuda:N, got {dev!r}")
    if not 0.0 < args.mem_fraction_static <= 1.0:  # vLLM's --gpu-memory-utilization takes 1.0 too
        raise ArgError(f"--mem-fraction-static (--gpu-memory-utilization): must be in (0, 1], "
                       f"got {args.mem_fraction_static}")
    if args.cuda_graph_bs is not None and (not args.cuda_graph_bs or min(args.cuda_graph_bs) <= 0):
        raise ArgError(f"--cuda-graph-bs: expected positive batch sizes, got {list(args.cuda_graph_bs or ())}")
    if args.attention_backend == "flashinfer" and args.device == "cpu":
        raise ArgError("--attention-backend flashinfer: needs a CUDA device (use triton or torch with --device cpu)")
    if args.dp_base_port is not None and not 0 < args.dp_base_port <= 65535 - args.dp_size:
        raise ArgError(f"--dp-base-port: must leave room for {args.dp_size} ports below 65536, got {args.dp_base_port}")
    _check_ops(args)
    _check_spec(args)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ArgError("--enable-auto-tool-choice: requires --tool-call-parser "
                       f"(one of {', '.join(TOOL_CALL_PARSERS)})")
    return args


def _check_ops(args: ServerArgs) -> None:
    if args.shutdown_timeout < 0:
        raise ArgError(f"--shutdown-timeout: must be >= 0 seconds, got {args.shutdown_timeout}")
    if args.max_engine_restarts < 0:
        raise ArgError(f"--max-engine-restarts: must be >= 0, got {args.max_engine_restarts}")
    if args.api_key is not None and not args.api_key.strip():
        raise ArgError("--api-key: must not be empty (leave it out to serve without a key)")
    if args.metrics_require_key and args.api_key is None:
        raise ArgError("--metrics-require-key: needs --api-key (or TANDEM_API_KEY)")
    if args.curve_keys_dir is not None and args.transport != "tcp":
        raise ArgError("--curve-keys-dir: only used with --transport tcp")


def _check_spec(args: ServerArgs) -> None:
    if args.speculative_algorithm is None:
        return
    if not args.speculative_draft_model_path:
        raise ArgError("--speculative-draft-model-path: required with --speculative-algorithm")
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


def validate(args: ServerArgs) -> ServerArgs:
    """``check_values``, then the checkpoint directories, the context length against the model's
    and the chat template; the device last (it may load the NVIDIA driver)."""
    check_values(args)
    _check_checkpoint("--model-path", args.model_path)
    tok = args.tokenizer_dir
    if not os.path.isfile(os.path.join(tok, "tokenizer.json")):
        raise ArgError(f"--tokenizer-path: no tokenizer.json in {tok!r}")
    if args.spec_enabled:
        _check_checkpoint("--speculative-draft-model-path", args.speculative_draft_model_path)
    _check_context_length(args)
    _check_files(args)
    if args.device.startswith("cuda"):
        from common.devices import check_cuda_device  # noqa: PLC0415 - loads the NVIDIA driver

        why = check_cuda_device(args.device)
        if why is not None:
            raise ArgError(f"--device {args.device}: {why}")
    return args


def _check_checkpoint(flag: str, path: str | None) -> None:
    if path is None or not os.path.isdir(path):
        raise ArgError(f"{flag}: {path!r} is neither a local directory nor a Hugging Face Hub id "
                       "(name or org/name)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ArgError(f"{flag}: no config.json in {path!r}")


def max_position_embeddings(model_dir: str) -> int | None:
    """The model's trained context (``text_config``'s for multimodal configs), as the worker reads it."""
    cfg = read_json(os.path.join(model_dir, "config.json"))
    cfg = cfg.get("text_config", cfg)
    value = cfg.get("max_position_embeddings")
    return int(value) if isinstance(value, (int, float)) and value > 0 else None


def _check_context_length(args: ServerArgs) -> None:
    limit = max_position_embeddings(args.model_path)
    if args.context_length is None or limit is None or args.context_length <= limit:
        return
    if not args.allow_long_context_length:
        raise ArgError(f"--context-length (--max-model-len): {args.context_length} is past the model's "
                       f"max_position_embeddings {limit}; add --allow-long-context-length to serve it anyway")


def _check_files(args: ServerArgs) -> None:
    if args.chat_template is not None:
        from common.jinja_env import compile_template, read_template_source  # noqa: PLC0415 - jinja2 only when asked

        try:
            compile_template(read_template_source(args.chat_template))
        except ValueError as exc:
            raise ArgError(f"--chat-template: {exc}") from None
    if args.curve_keys_dir is not None:
        from proto.curve import CurveKeyError, load_keys  # noqa: PLC0415 - zmq only when asked

        try:
            load_keys(args.curve_keys_dir)
        except CurveKeyError as exc:
            raise ArgError(f"--curve-keys-dir: {exc}") from None
