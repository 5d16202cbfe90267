"""Chat requests into a GenPlan: the template's text, the prompt's checks, the constraint (a
response format or a forced tool call, after the reasoning under a reasoning parser), and how
the answer is parsed (tools, reasoning). The rules shared with completions are in ``params``."""

from __future__ import annotations

from tokenizer_proc.chat_messages import validate_messages, validate_tools
from tokenizer_proc.chat_template import ChatTemplate, ChatTemplateError
from tokenizer_proc.errors import bad_request
from tokenizer_proc.params import (
    GenPlan,
    Limits,
    check_context,
    check_logit_bias,
    check_min_tokens,
    check_token_ids,
    check_unsupported,
    continuous_usage,
    encode_prompt,
    include_usage,
    sampling_params,
    stop_config,
)
from tokenizer_proc.protocol import ChatCompletionRequest
from tokenizer_proc.reasoning import grammar_after_reasoning, starts_in_reasoning, tags_are_special
from tokenizer_proc.structured import chat_grammar
from tokenizer_proc.tokenizer import TextTokenizer
from tokenizer_proc.tool_choice import resolve_tool_choice


def generation_prompt(req) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message): an unset add_generation_prompt gives way
    to continue_final_message; both set true is vLLM's 400."""
    cont = bool(req.continue_final_message)
    if cont and req.add_generation_prompt:
        raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                          "continue_final_message")
    return (not cont) if req.add_generation_prompt is None else req.add_generation_prompt, cont


def chat_text(req, template: ChatTemplate) -> str:
    validate_messages(req.messages)
    add_generation_prompt, continue_final_message = generation_prompt(req)
    try:
        return template.render(
            req.messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=getattr(req, "tools", None),
            documents=getattr(req, "documents", None),
            extra_vars=getattr(req, "chat_template_kwargs", None),
        )
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from None


def plan_chat(
    req: ChatCompletionRequest, tok: TextTokenizer, template: ChatTemplate, limits: Limits, defaults: dict,
    server_tool_parser: str | None = None, server_reasoning_parser: str | None = None,
) -> GenPlan:
    """``server_tool_parser``: the parser name when the server has both tool-calling flags;
    ``server_reasoning_parser``: --reasoning-parser (SGLang's ``separate_reasoning: false`` keeps the
    grammar's wait for the reasoning's end and skips only the split)."""
    check_unsupported(req)
    validate_tools(req.tools)
    tools = resolve_tool_choice(req.tool_choice, req.tools, server_tool_parser, req.parallel_tool_calls is not False)
    grammar = chat_grammar(req, tools.grammar)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    text = chat_text(req, template)
    # HF tokenizes rendered chats without special tokens: the template wrote any BOS itself.
    ids = encode_prompt(text, tok, limits, "messages", add_special_tokens=False)
    reasoning = None
    if server_reasoning_parser:
        reasoning = starts_in_reasoning(server_reasoning_parser, text, req.chat_template_kwargs,
                                        req.continue_final_message)
        grammar, reasoning = grammar_after_reasoning(grammar, reasoning, tok)
        # SGLang's separate_reasoning: false: the model still reasons first and the grammar still
        # waits for the tag; only the split into reasoning and content is off.
        if req.separate_reasoning is False:
            reasoning = None
    if not ids:
        raise bad_request("the rendered chat prompt is empty", "messages")
    if len(ids) >= limits.max_context:
        raise bad_request(
            f"This model's maximum context length is {limits.max_context} tokens. However, your messages "
            f"resulted in {len(ids)} tokens. Please reduce the length of the messages.",
            "messages",
        )
    requested = req.max_completion_tokens or req.max_tokens
    max_tokens = requested if requested is not None else limits.max_context - len(ids)
    check_context(len(ids), max_tokens, limits)
    check_min_tokens(req.min_tokens, max_tokens)
    if req.stop_token_ids:
        check_token_ids(req.stop_token_ids, limits, "stop_token_ids")
    check_logit_bias(req.logit_bias, limits)
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens, defaults, -1 if top is None else top, -1, req.min_tokens, req.seed,
                             grammar)
    echo_text = chat_echo_text(req.messages) if req.echo else ""
    return GenPlan(
        prompts=[ids],
        params=params,
        stop_cfg=stop_config(req, keep_special=tools.keeps_special_tokens
                           or (reasoning is not None and tags_are_special(tok))),
        n=req.n or 1,
        stream=bool(req.stream),
        include_usage=include_usage(req),
        continuous_usage=continuous_usage(req),
        top_logprobs=top,
        echo=bool(echo_text),
        prompt_texts=[echo_text] if echo_text else [],
        tool_parser=tools.parser,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        reasoning=reasoning,
        include_reasoning=req.include_reasoning is not False,
    )


def chat_echo_text(messages: list[dict]) -> str:
    """vLLM's chat ``echo``: a final assistant message (a prefill, usually with
    continue_final_message) is repeated at the start of the answer; any other last turn echoes
    nothing. Text parts are joined as the template saw them."""
    last = messages[-1]
    if last.get("role") != "assistant":
        return ""
    content = last.get("content") or ""
    if isinstance(content, list):
        return "\n".join(p.get(p.get("type"), "") for p in content if isinstance(p, dict))
    return content
