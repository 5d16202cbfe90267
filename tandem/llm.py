"""``tandem.LLM``: offline batch inference in Python, on the engine ``tandem serve`` runs.

``LLM(model, **engine_args)`` starts the scheduler and worker processes (ZMQ, overlap, MTP, CUDA
graphs: the server's engine, started by its ``Supervisor``); this process is their front. Prompts
go through the HTTP front's own code: its tokenizer, chat template, request checks
(``tokenizer_proc/params.py``, ``plan_chat.py``: a request the server answers with a 400 raises
ValueError here, with the same message), detokenizer and stop strings (``RequestState``).
Names follow vLLM's offline API (``generate``, ``chat``, ``SamplingParams``, ``RequestOutput``).

    from tandem import LLM, SamplingParams
    with LLM("models/tiny-shakespeare/target") as llm:
        out = llm.generate(["To be"], SamplingParams(temperature=0, max_tokens=16))
        print(out[0].outputs[0].text)

Engine arguments are ``ServerArgs`` fields (``tandem serve``'s flags with ``_`` for ``-``, e.g.
``speculative_draft_model_path``, ``tp_size``, ``max_running_requests``). The engine's processes
are children of the thread that builds the ``LLM`` (they die with it: build it in a thread that
outlives its use, as the main thread does).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import itertools
import time
import weakref
from typing import Any, Callable, Sequence

import msgspec

from common.args import ServerArgs
from common.flags import flag_fields
from common.jinja_env import read_template_source
from common.serve_cli import prepare_server_args
from proto.messages import SchedulerStats
from tandem.llm_batch import BatchRun, PlannedRequest
from tandem.llm_engine import EngineError, EngineLink
from tandem.llm_outputs import RequestOutput, completion_output, prompt_logprobs, request_metrics
from tandem.llm_params import SamplingParams
from tokenizer_proc.chat_template import ChatTemplate
from tokenizer_proc.errors import APIError, decode_body
from tokenizer_proc.params import GenPlan, Limits, encode_prompt, load_generation_defaults, plan_completion
from tokenizer_proc.plan_chat import chat_text, plan_chat
from tokenizer_proc.protocol import ChatCompletionRequest, CompletionRequest
from tokenizer_proc.request_state import RequestState
from tokenizer_proc.tokenizer import TextTokenizer, TokenizerError

Prompt = Any  # str | list[int] | {"prompt": str} | {"prompt_token_ids": list[int]}
_json = msgspec.json.Encoder()


class _NoText:
    """A request's detokenizer under ``detokenize=False``: token ids only, no text, no work."""

    has_pending = False

    def add(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def engine_args(model: str, **kwargs) -> ServerArgs:
    """``ServerArgs`` for ``LLM(model, **kwargs)``, prepared as ``tandem serve`` prepares its
    flags (values checked, Hub ids resolved, checkpoints read: ValueError naming the flag). A
    keyword is a ``ServerArgs`` field or any long name of its flag with ``_`` for ``-`` (vLLM's
    ``tensor_parallel_size``, ``max_model_len``, ``seed`` ...); a string value is read as the
    flag reads it (``max_model_len="32k"``, ``dtype="half"``). An unknown name is a TypeError."""
    names, parsers = _argument_names()
    fields: dict[str, object] = {}
    for key, value in kwargs.items():
        name = names.get(key)
        if name is None:
            raise TypeError(f"LLM(): unknown engine argument {key!r}; engine arguments are tandem serve's flags "
                            "with '_' for '-' (see `tandem serve --help`)")
        if name in fields:
            raise TypeError(f"LLM(): {key!r} sets {name!r}, which another argument already set")
        parse = parsers.get(name)
        fields[name] = parse(value) if parse is not None and isinstance(value, str) else value
    return prepare_server_args(ServerArgs(model_path=model, **fields))


@functools.lru_cache(maxsize=1)
def _argument_names() -> tuple[dict[str, str], dict[str, Callable]]:
    """({keyword: ServerArgs field}, {field: its flag's parser}), from the fields' flag
    declarations (``common.args``); a switch that stores the opposite (``--skip-warmup``) is
    reachable by its field's name only."""
    names = {f.name: f.name for f in dataclasses.fields(ServerArgs) if f.name != "model_path"}
    parsers = {}
    for path, f, flag, _ in flag_fields(ServerArgs):
        if len(path) != 1 or f.name == "model_path":
            continue
        if flag.parse is not None:
            parsers[f.name] = flag.parse
        if not flag.invert:
            names.update({n[2:].replace("-", "_"): f.name for n in flag.names if n.startswith("--")})
    return names, parsers


class LLM:
    def __init__(self, model: str, **engine_arguments):
        self.args = engine_args(model, **engine_arguments)
        try:
            self.tokenizer = TextTokenizer(self.args.tokenizer_dir)
        except TokenizerError as exc:
            raise ValueError(f"tokenizer: {exc}") from None
        override = read_template_source(self.args.chat_template) if self.args.chat_template is not None else None
        self.chat_template = ChatTemplate.from_tokenizer(self.tokenizer, override)
        self.generation_defaults = load_generation_defaults(self.args.model_path)
        self._engine = EngineLink(self.args)
        info = self._engine.info
        self._limits = Limits(max_context=info.max_context, vocab_size=info.vocab_size)
        self._ids = itertools.count()
        # Stopped when this object is collected, or at the interpreter's exit (atexit hooks run
        # last-registered first, so before any hook registered earlier that waits on children).
        self._stop = weakref.finalize(self, EngineLink.close, self._engine)
        self._stop.atexit = False
        atexit.register(self._stop)

    # ------------------------------------------------------------------ public API
    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, *, use_tqdm: bool | Callable = True) -> list[RequestOutput]:
        """Complete each prompt (a string, a list of token ids, or vLLM's ``{"prompt": ...}`` /
        ``{"prompt_token_ids": ...}``); one ``RequestOutput`` per prompt, in the input order.
        ``sampling_params``: one for all prompts, or one per prompt."""
        batch = _prompt_list(prompts)
        params = _params_list(sampling_params, len(batch))
        planned = [self._plan_prompt(p, sp) for p, sp in zip(batch, params)]
        return self._run(planned, use_tqdm)

    def chat(self, messages: list[dict] | Sequence[list[dict]], sampling_params: SamplingParams
             | Sequence[SamplingParams] | None = None, use_tqdm: bool | Callable = True, *,
             chat_template: str | None = None, add_generation_prompt: bool | None = None,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             documents: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Answer each conversation (a list of ``{"role", "content"}`` messages, or a list of such
        lists) through the model's chat template (``chat_template``: another one, a file or the
        Jinja text). ``tools`` reach the template; the answer is not parsed into tool calls."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        params = _params_list(sampling_params, len(convs))
        template = self.chat_template
        if chat_template is not None:
            template = ChatTemplate(read_template_source(chat_template), self.tokenizer)
        extra = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                 "tools": tools, "tool_choice": "none" if tools else None, "documents": documents,
                 "chat_template_kwargs": chat_template_kwargs}
        planned = [self._plan_chat(conv, sp, template, extra) for conv, sp in zip(convs, params)]
        return self._run(planned, use_tqdm)

    def get_tokenizer(self) -> TextTokenizer:
        """The front's tokenizer (``encode``, ``decode``; ``tokenizer.json`` through ``tokenizers``)."""
        return self.tokenizer

    def engine_stats(self) -> SchedulerStats | None:
        """The scheduler's latest ``SchedulerStats`` (cumulative counters: steps, speculative
        acceptance, device busy time ...), once it reports idle after the last call."""
        return self._engine.idle_stats()

    def shutdown(self) -> None:
        """Stop the engine's processes (also done by ``with``, garbage collection and exit)."""
        self._stop()
        atexit.unregister(self._stop)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ planning
    def _plan_prompt(self, prompt: Prompt, sp: SamplingParams) -> PlannedRequest:
        text, ids = self._tokens(prompt)
        max_tokens = sp.max_tokens if sp.max_tokens is not None else max(1, self._limits.max_context - len(ids))
        req = _request({"prompt": ids, **sp.completion_fields(max_tokens)}, CompletionRequest)
        plan = _checked(plan_completion, req, self.tokenizer, self._limits, self.generation_defaults)
        return self._planned(text, plan, sp)

    def _plan_chat(self, conv: list[dict], sp: SamplingParams, template: ChatTemplate, extra: dict) -> PlannedRequest:
        fields = {"messages": conv, **sp.chat_fields(), **{k: v for k, v in extra.items() if v is not None}}
        req = _request(fields, ChatCompletionRequest)
        plan = _checked(plan_chat, req, self.tokenizer, template, self._limits, self.generation_defaults)
        if sp.prompt_logprobs is not None:
            plan.params = msgspec.structs.replace(plan.params, prompt_logprobs=sp.prompt_logprobs)
        return self._planned(chat_text(req, template), plan, sp)

    def _tokens(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if set(prompt) == {"prompt"}:
                prompt = prompt["prompt"]
            elif set(prompt) == {"prompt_token_ids"}:
                prompt = list(prompt["prompt_token_ids"])
            else:
                raise ValueError(f"a prompt dict has 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, _checked(encode_prompt, prompt, self.tokenizer, self._limits, "prompt")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise TypeError(f"a prompt is a string, a list of token ids or a prompt dict, got {type(prompt).__name__}")

    def _planned(self, text: str | None, plan: GenPlan, sp: SamplingParams) -> PlannedRequest:
        request_id = str(next(self._ids))
        states = [RequestState(f"llm-{request_id}-{j}", j, plan.prompts[0], plan.choice_params(j), plan.stop_cfg,
                               self.tokenizer) for j in range(plan.n)]
        if not sp.detokenize:
            for state in states:
                state.detok = _NoText()
        return PlannedRequest(request_id, text, states, sp.logprobs is not None)

    # ------------------------------------------------------------------ running
    def _run(self, planned: list[PlannedRequest], use_tqdm: bool | Callable) -> list[RequestOutput]:
        if self._engine.dead_reason is not None:
            raise EngineError(f"the engine died: {self._engine.dead_reason}")
        if self._engine.closed:
            raise RuntimeError("this LLM was shut down")
        bar = _progress(use_tqdm, len(planned))
        start, tokens = time.perf_counter(), 0

        def done(req: PlannedRequest) -> None:
            nonlocal tokens
            if bar is not None:
                tokens += sum(s.n_tokens for s in req.states)
                bar.set_postfix_str(f"output {tokens / max(1e-9, time.perf_counter() - start):.0f} tok/s", refresh=False)
                bar.update(1)

        try:
            BatchRun(self._engine, planned, done).run()
        finally:
            if bar is not None:
                bar.close()
        return [self._output(req) for req in planned]

    def _output(self, req: PlannedRequest) -> RequestOutput:
        first = req.states[0]
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=list(first.prompt_ids),
            prompt_logprobs=prompt_logprobs(self.tokenizer, first) if first.params.prompt_logprobs >= 0 else None,
            outputs=[completion_output(self.tokenizer, r, req.want_logprobs) for r in req.results or ()],
            metrics=request_metrics(req.states, req.finished_time),
            num_cached_tokens=first.cached_tokens,
        )


# ---------------------------------------------------------------------- helpers
def _prompt_list(prompts) -> list:
    """One prompt (a string, a dict, a flat list of token ids) or a sequence of them."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return prompts


def _params_list(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts: give one, or one per prompt")
    return params


def _request(fields: dict, typ: type):
    """The request body the HTTP front would decode, checked the same way (ValueError)."""
    return _checked(decode_body, _json.encode(fields), typ)


def _checked(fn, *args):
    """``fn(*args)``, its HTTP 400 (an APIError) raised as a ValueError with the same message."""
    try:
        return fn(*args)
    except APIError as exc:
        raise ValueError(exc.message) from None


def _progress(use_tqdm: bool | Callable, total: int):
    if not use_tqdm:
        return None
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="Processed prompts")
    from tqdm.auto import tqdm  # noqa: PLC0415

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
