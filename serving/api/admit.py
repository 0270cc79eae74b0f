"""Admit: a request body becomes its engine requests, each built whole, and the server admits them or refuses
at once. The first of the request path's three steps (admit → run → respond).

Top to bottom, each check once, at its layer:
- the body's shape and ranges (sampling fields, an empty prompt): the pydantic schemas, before a router runs;
- the served model name, then the prompt: chat messages through the chat template (the tools in it, or the
  fallback below), or the completion prompts encoded; both off the event loop;
- the grammar a response_format or a forced tool_choice needs, compiled off the event loop (cached by schema in
  serving/engine/grammar.py: the engine loop never compiles);
- per choice, the engine request, whole: sampling params, max_tokens, stop, logprobs, its seed, the grammar;
- the server's limits (input and output length) and its expected queue wait: refused here, before anything runs;
- the engine's own limits (the context length, token ids, KV cache, queue): the engine's one admission check, run
  when the run starts (serving/api/run.py), before any output, so a stream can still answer with its status code.

Tools use one text convention, the Hermes / Qwen one (serving/api/render/tool_calls.py parses it back). A chat
template that knows tools (it mentions `tools`) gets them through `apply_chat_template(..., tools=...)`; any other
template gets the documented fallback: a system message that lists the tools and the format, assistant tool calls
written back in the format and tool results as user messages in `<tool_response>` tags. tool_choice "required" or
a named function is enforced by a grammar (one call, of one of the allowed functions, with arguments valid against
its parameters); "auto" lets the model choose; "none" leaves the tools out of the prompt.

The Responses API is a translation: its request becomes a chat completion request (``to_chat``) and takes this
same path; its errors name the fields as a response request calls them (``as_sent``).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from serving.api.errors import ApiError
from serving.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    FunctionCallItem,
    InputMessage,
    NamedToolChoice,
    ResponsesRequest,
    SamplingFields,
)
from serving.api.state import Engine, ServerState
from serving.engine.grammar import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, GrammarError, GrammarSpec, compiler_for
from serving.engine.types import SEED_RANGE, GenerationRequest, SamplingParams


@dataclass
class Admission:
    """One HTTP request's engine requests, admitted: ``group_size`` choices per prompt, prompt by prompt."""

    requests: list[GenerationRequest]
    group_size: int
    prompt_ids: list[list[int]]  # one per prompt
    received_at: float
    log_fields: dict[str, Any]  # the access log's fields of this request


async def admit_chat(body: ChatCompletionRequest, request: Request, engine: Engine, state: ServerState,
                     id_prefix: str = "chatcmpl") -> Admission:
    """A chat request: its prompt rendered and tokenized, its grammar compiled (both off the event loop)."""
    check_model(state, body.model)
    messages = chat_messages(body)
    tools = template_tools(body)
    pool = state.tokenizers
    pool.check_length(sum(len(m["content"]) for m in messages) + len(json.dumps(tools or [])), "messages")
    prompt_ids = await pool.run(lambda: encode_chat(engine.tokenizer, messages, tools))  # off the event loop
    grammar = await compile_grammar(engine, body)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return admit(request, state, engine, body, [prompt_ids], body.output_limit, logprobs, grammar, id_prefix,
                 body.choices)


async def admit_completion(body: CompletionRequest, request: Request, engine: Engine,
                           state: ServerState) -> Admission:
    """A completions request: each prompt encoded (text off the event loop), best_of candidates per prompt."""
    check_model(state, body.model)
    prompt_ids = [list(p) if isinstance(p, list) else await state.tokenizers.encode(p, add_special_tokens=True)
                  for p in body.prompts]  # none empty: the schema refuses that
    # echo with logprobs scores the prompt too; max_tokens=0 (echo only) needs the prompt's scoring to finish
    prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    if body.max_tokens == 0 and prompt_logprobs is None:
        prompt_logprobs = 0
    ranked = body.candidates > body.choices  # best_of: every candidate needs its logprobs to be ranked
    logprobs = body.logprobs if body.logprobs is not None or not ranked else 0
    grammar = await compile_grammar(engine, body)  # response_format
    return admit(request, state, engine, body, prompt_ids, body.max_tokens, logprobs, grammar, "cmpl",
                 body.candidates, prompt_logprobs)


async def admit_response(body: ResponsesRequest, request: Request, engine: Engine,
                         state: ServerState) -> tuple[ChatCompletionRequest, Admission]:
    """A Responses API request: translated to the chat request it is generated by, and admitted as that."""
    chat = to_chat(body)
    try:
        return chat, await admit_chat(chat, request, engine, state, "resp")
    except ApiError as exc:  # its limits and checks, in the words of this API
        raise as_sent(exc) from exc


def admit(request: Request, state: ServerState, engine: Engine, body: SamplingFields, prompt_ids: list[list[int]],
          max_tokens: int | None, logprobs: int | None, grammar: Any | None, id_prefix: str, count: int,
          prompt_logprobs: int | None = None) -> Admission:
    """Build every choice's engine request whole (choice i of a prompt seeded seed + i), then admit them."""
    requests = []
    for ids in prompt_ids:
        tokens = server_limits(state, engine, max_tokens, len(ids))
        for index in range(count):
            params = sampling_params(body, tokens, logprobs, choice_seed(body.seed, index), prompt_logprobs)
            requests.append(GenerationRequest(new_request_id(id_prefix), ids, params, grammar))
    check_queue_wait(state, engine)
    scope_state = request.scope.setdefault("state", {})
    fields: dict[str, Any] = scope_state.setdefault("log_fields", {})
    fields["engine_request_id"] = requests[0].request_id  # the one the response carries
    return Admission(requests, count, prompt_ids, scope_state.get("received_at", time.monotonic()), fields)


def check_model(state: ServerState, model: str) -> None:
    """404 unless ``model`` is the name this server serves."""
    if model != state.settings.model_name:
        raise ApiError(404, f"model {model!r} does not exist; this server serves {state.settings.model_name!r}",
                       param="model", code="model_not_found")


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def server_limits(state: ServerState, engine: Engine, requested: int | None, prompt_len: int) -> int:
    """Check the prompt and max_tokens against the server's limits and pick max_tokens (default: what fits in the
    context, capped). Whether prompt + max_tokens fits the context is the engine's admission's to say."""
    limits = state.settings.config.scheduler
    if prompt_len > limits.max_input_len:
        raise ApiError(400, f"prompt has {prompt_len} tokens; the maximum input length is {limits.max_input_len}",
                       param="prompt", code="context_length_exceeded")
    if requested is not None and requested > limits.max_output_len:
        raise ApiError(400, f"max_tokens is {requested}; the maximum output length is {limits.max_output_len}",
                       param="max_tokens", code="invalid_value")
    return requested if requested is not None else min(limits.max_output_len, engine.max_model_len - prompt_len)


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice ``index``'s seed: seed + index, wrapped within the signed 64-bit range the generator takes."""
    if seed is None or index == 0:
        return seed
    span = SEED_RANGE[1] - SEED_RANGE[0] + 1
    return (seed + index - SEED_RANGE[0]) % span + SEED_RANGE[0]


def sampling_params(body: SamplingFields, max_tokens: int, logprobs: int | None, seed: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The body's sampling fields (already range-checked by the schema) as the engine's parameters."""
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        seed=seed,
        max_tokens=max_tokens,
        stop=body.stop_list,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias={int(token): bias for token, bias in (body.logit_bias or {}).items()},
        prompt_logprobs=prompt_logprobs,
    )


def check_queue_wait(state: ServerState, engine: Engine) -> None:
    """The server's admission: refuse at once what would wait past its timeout in the queue."""
    timeout = state.settings.config.scheduler.request_timeout_s
    wait = state.expected_queue_wait_s(engine.stats())
    if wait > timeout:
        raise ApiError(503, f"overloaded: expected queue wait {wait:.1f}s exceeds the request timeout {timeout:g}s",
                       code="overloaded", retry_after=min(wait, 60.0))


# ---- grammars -----------------------------------------------------------------------------------------------


def grammar_spec(body: SamplingFields) -> tuple[GrammarSpec, str] | None:
    """The grammar a request's output must follow, and the field that asked for it (None: unconstrained)."""
    if isinstance(body, ChatCompletionRequest) and body.tools and body.forced_tool_choice:
        choice = body.tool_choice
        allowed = [t.function for t in body.tools
                   if not isinstance(choice, NamedToolChoice) or t.function.name == choice.function.name]
        return _spec(lambda: GrammarSpec.tool_call({f.name: f.parameters for f in allowed}), "tools"), "tools"
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec("json_object"), "response_format"
    assert fmt.json_schema is not None
    schema = fmt.json_schema.schema_
    spec = GrammarSpec("json_object") if not schema else _spec(lambda: GrammarSpec.json_schema(schema),
                                                              "response_format")
    return spec, "response_format"


def _spec(make: Any, param: str) -> GrammarSpec:
    try:
        spec: GrammarSpec = make()
    except GrammarError as exc:
        raise ApiError(400, f"{param}: {exc}", param=param, code="invalid_schema") from exc
    return spec


async def compile_grammar(engine: Engine, body: SamplingFields) -> Any | None:
    """The request's compiled grammar (None: unconstrained), compiled off the event loop; a schema xgrammar
    cannot compile is a 400 naming the problem. Every choice's engine request follows it (each gets its own
    matcher in the engine)."""
    wanted = grammar_spec(body)
    if wanted is None:
        return None
    spec, param = wanted
    if engine.tokenizer is None:
        raise ApiError(400, f"{param}: structured output needs a tokenizer; this model has none", param=param)
    compiler = compiler_for(engine.tokenizer)
    try:
        return await asyncio.to_thread(compiler.compile, spec)
    except GrammarError as exc:
        raise ApiError(400, f"{param}: {exc}", param=param, code="invalid_schema") from exc


# ---- chat prompts -------------------------------------------------------------------------------------------


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation as chat templates take it: OpenAI's shape, tool call arguments parsed to objects."""
    messages: list[dict[str, Any]] = []
    for m in body.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.text}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments_object(c.function.arguments)}}
                for c in m.tool_calls]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.name:
            message["name"] = m.name
        messages.append(message)
    return messages


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments else {}
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"messages: tool call arguments are not JSON: {exc}", param="messages") from exc


def template_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as a chat template takes them (None with tool_choice "none" or no tools)."""
    if not body.tools_active:
        return None
    return [t.model_dump(exclude_none=True) for t in body.tools or []]


def template_knows_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    """For a template without tool support: tools described in a system message, calls and results as text."""
    out: list[dict[str, str]] = []
    if tools:
        listing = "\n".join(json.dumps(t["function"], sort_keys=True) for t in tools)
        out.append({"role": "system", "content": (
            "You may call functions. The available functions, one JSON object each:\n" + listing + "\n"
            f'To call one, reply with {TOOL_CALL_OPEN}{{"name": <function name>, "arguments": <arguments '
            f"object>}}{TOOL_CALL_CLOSE}; function results come back in <tool_response></tool_response> tags.")})
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
            continue
        text = m["content"]
        for call in m.get("tool_calls", []):
            payload = json.dumps({"name": call["function"]["name"], "arguments": call["function"]["arguments"]})
            text += f"{TOOL_CALL_OPEN}{payload}{TOOL_CALL_CLOSE}"
        out.append({"role": m["role"], "content": text})
    return out


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
                ) -> list[int]:
    """Render the tokenizer's chat template with the assistant prompt appended, then tokenize. Tools go
    through the template when it knows them, else through the fallback above."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ApiError(400, "this model has no chat template; use /v1/completions", code="no_chat_template")
    try:
        if template_knows_tools(tokenizer):
            text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        else:
            text = tokenizer.apply_chat_template(fallback_messages(messages, tools), tokenize=False,
                                                 add_generation_prompt=True)
    except Exception as exc:  # template errors are the request's fault (e.g. role order)
        raise ApiError(400, f"messages: cannot apply the chat template: {exc}", param="messages") from exc
    # The template already carries BOS and special tokens.
    return list(tokenizer.encode(text, add_special_tokens=False))


# ---- the Responses API's request as a chat request ------------------------------------------------------------
#
#   input (a string, or message / function_call / function_call_output items) + instructions → chat messages
#   text.format (json_object / json_schema) → response_format;  tools (function) and tool_choice → chat's
#   max_output_tokens → max_completion_tokens;  include message.output_text.logprobs + top_logprobs → logprobs

# chat's names for the fields a response request sets (its errors say them the Responses API's way)
_CHAT_PARAMS = {"messages": "input", "prompt": "input", "response_format": "text.format",
                "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens"}
_CHAT_NAME = re.compile(r"\b(" + "|".join(_CHAT_PARAMS) + r")\b")


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request this response is generated by."""
    chat: dict[str, Any] = {
        "model": body.model, "messages": responses_messages(body), "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
        "stream": False, "parallel_tool_calls": body.parallel_tool_calls,
    }
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_,
                                                                          "strict": fmt.strict}}
    elif fmt is not None:
        chat["response_format"] = {"type": fmt.type}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in body.tools]
    choice = body.tool_choice
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    chat["tool_choice"] = choice
    if body.wants_logprobs:
        chat |= {"logprobs": True, "top_logprobs": body.top_logprobs or 0}
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:  # a rule of chat's (e.g. a forced tool_choice with a format): named as sent
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else ""
        message = str(first["msg"]).removeprefix("Value error, ")
        named = _CHAT_NAME.search(message)
        param = field or (named.group(1) if named else None)
        raise as_sent(ApiError(400, f"{param}: {message}" if field else message, param=param,
                               code="invalid_value")) from exc


def as_sent(exc: ApiError) -> ApiError:
    """An error of chat's request path with the fields named as a response request calls them."""
    if exc.param not in _CHAT_PARAMS and not _CHAT_NAME.search(exc.message):
        return exc
    return ApiError(exc.status, _CHAT_NAME.sub(lambda m: _CHAT_PARAMS[m.group(1)], exc.message), code=exc.code,
                    param=_CHAT_PARAMS.get(exc.param or "", exc.param), retry_after=exc.retry_after)


def responses_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """instructions first (a system message), then the input: function calls join the assistant message before
    them (or make one), their outputs become tool messages."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    for item in body.input:
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
    return messages
