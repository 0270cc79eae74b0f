"""Request bodies of the OpenAI-compatible endpoints. Unknown fields are ignored, like OpenAI's own
SDK extras; fields we accept but cannot honour are refused with a 400 naming them."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from serving.engine.types import (
    LOGIT_BIAS_RANGE,
    MAX_LOGPROBS,
    MIN_TOP_K,
    PENALTY_RANGE,
    SEED_RANGE,
    TEMPERATURE_RANGE,
    TOP_P_RANGE,
)

MAX_STOP_SEQUENCES = 4
MAX_CHOICES = 16  # n (and best_of): engine requests one HTTP request may start
MAX_PROMPTS = 32  # prompts in one completions request (choices: prompts x n, at most 4 x MAX_CHOICES)
# Errors these schemas raise with their own code; the message names the field itself.
EMPTY_PROMPT = "empty_prompt"
INVALID_TEXT = "invalid_text"
UNSUPPORTED_FIELD = "unsupported_field"
SCHEMA_ERROR_CODES = frozenset({EMPTY_PROMPT, INVALID_TEXT, UNSUPPORTED_FIELD})


def _lone_surrogate(value: Any, path: str) -> tuple[str, str] | None:
    """(field path, escaped character) of the first string in ``value`` that is not valid Unicode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return path or "body", f"\\u{ord(value[exc.start]):04x}"
        return None
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _lone_surrogate(key, path) if isinstance(key, str) else None
        found = found or _lone_surrogate(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


class ApiBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        """JSON may escape a lone surrogate (\\ud800); no tokenizer can encode one: 400, not 500."""
        found = _lone_surrogate(data, "")
        if found is not None:
            raise PydanticCustomError(INVALID_TEXT, "{param}: contains a lone surrogate {char}; text must be "
                                      "valid Unicode", {"param": found[0], "char": found[1]})
        return data


class StreamOptions(ApiBody):
    include_usage: bool = False


class JsonSchemaFormat(ApiBody):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")  # {} (no schema): any JSON object
    strict: bool | None = None


class ResponseFormat(ApiBody):
    """Structured outputs: the output is constrained by a grammar (serving/engine/grammar.py)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self


class FunctionDef(ApiBody):
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no parameters
    strict: bool | None = None


class ToolDef(ApiBody):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(ApiBody):
    name: str


class NamedToolChoice(ApiBody):
    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(ApiBody):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCall(ApiBody):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class RefusingBody(ApiBody):
    """A request body with OpenAI fields this server refuses by name."""

    # OpenAI fields this server does not honour and whose absence would change the answer: 400 naming the field.
    # (Harmless extras, metadata and hints, are ignored: docs/server.md lists every field.)
    refused_fields: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, why in cls.refused_fields.items():
                value = data.get(name)
                # an empty object still asks for something (web_search_options: {} turns web search on)
                if value is None or value is False or value == [] or (name == "modalities" and value == ["text"]):
                    continue
                raise PydanticCustomError(UNSUPPORTED_FIELD, "{param} is not supported: {why}",
                                          {"param": name, "why": why})
        return data


class SamplingFields(RefusingBody):
    model: str = Field(..., min_length=1)
    temperature: float | None = Field(None, ge=TEMPERATURE_RANGE[0], le=TEMPERATURE_RANGE[1])
    top_p: float | None = Field(None, gt=TOP_P_RANGE[0], le=TOP_P_RANGE[1])
    top_k: int | None = Field(None, ge=MIN_TOP_K)
    n: int | None = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    presence_penalty: float | None = Field(0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    frequency_penalty: float | None = Field(0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    logit_bias: dict[str, float] | None = None  # token id (as a string, JSON keys are) -> bias in LOGIT_BIAS_RANGE
    ignore_eos: bool = False  # extension (benchmarks): generate exactly max_tokens
    response_format: ResponseFormat | None = None
    user: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not token.isdigit():
                raise ValueError(f"keys must be token ids, got {token!r}")
            if not LOGIT_BIAS_RANGE[0] <= bias <= LOGIT_BIAS_RANGE[1]:
                raise ValueError(f"bias of token {token} must be between {LOGIT_BIAS_RANGE[0]:g} and "
                                 f"{LOGIT_BIAS_RANGE[1]:g}, got {bias}")
        return value

    @property
    def choices(self) -> int:
        return self.n or 1

    @field_validator("stop")
    @classmethod
    def _stop_sequences(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    refused_fields: ClassVar[dict[str, str]] = {
        "suffix": "insertion (fill-in-the-middle) needs a model trained for it",
    }

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo: score the prompt, generate nothing
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)

    @model_validator(mode="after")
    def _choices_and_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 generates nothing; it needs echo=true (to score the prompt)")
        if self.best_of is not None and self.best_of < self.choices:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.choices})")
        if self.best_of not in (None, self.choices) and self.stream:
            raise ValueError("best_of cannot be used with stream (the best choices are known only at the end)")
        return self

    @property
    def candidates(self) -> int:
        """Choices generated: best_of of them, of which the n with the highest mean logprob are returned."""
        return self.best_of or self.choices

    @field_validator("prompt")
    @classmethod
    def _prompts(
        cls, value: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        prompts = value if isinstance(value, list) and value and isinstance(value[0], (str, list)) else [value]
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request, got {len(prompts)}")
        if any(not p for p in prompts):
            raise PydanticCustomError(EMPTY_PROMPT, "prompt is empty")
        return value

    @model_validator(mode="after")
    def _engine_requests(self) -> CompletionRequest:
        total = len(self.prompts) * self.candidates
        if total > MAX_CHOICES * 4:
            raise ValueError(f"prompts x (best_of or n) = {total} engine requests; at most {MAX_CHOICES * 4}")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt, or each prompt of a batch (lm-evaluation-harness sends token-id batches)."""
        value = self.prompt
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            return list(value)  # type: ignore[arg-type]
        return [value]  # type: ignore[list-item]


class TextPart(ApiBody):
    type: Literal["text"]
    text: str


class ChatMessage(ApiBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers

    @model_validator(mode="after")
    def _tool_fields_by_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls is only allowed on assistant messages")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


def check_tool_choice(value: Any, named: str) -> Any:
    """A tool_choice of a shape this server knows, else an error naming the shapes it takes (not one per member of
    the union, under pydantic's own names for them)."""
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        return value
    raise ValueError(f'must be "none", "auto", "required" or {named}, got {json.dumps(value)[:80]}')


class ChatCompletionRequest(SamplingFields):
    refused_fields: ClassVar[dict[str, str]] = {
        "audio": "the served models produce text only",
        "modalities": "the served models produce text only (send [\"text\"] or leave it out)",
        "functions": "the deprecated function calling API: use tools",
        "function_call": "the deprecated function calling API: use tool_choice",
        "prediction": "predicted outputs are not implemented",
        "web_search_options": "the server has no web search",
        "moderation": "the server runs no moderation model; moderate the input and output before and after",
    }

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; a forced choice (required / named) makes one call

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, value: Any) -> Any:
        return check_tool_choice(value, '{"type": "function", "function": {"name": ...}}')

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        if self.tool_choice not in (None, "none", "auto") and not names:
            raise ValueError("tool_choice requires tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names function {self.tool_choice.function.name!r}, which is not in tools")
        if self.forced_tool_choice and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("response_format cannot be combined with a forced tool_choice")
        return self

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def forced_tool_choice(self) -> bool:
        """One call of a tool must be made: tool_choice "required" or a named function (a grammar enforces it)."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def tools_active(self) -> bool:
        """Tools go into the prompt and calls are parsed out of the output (not with tool_choice "none")."""
        return bool(self.tools) and self.tool_choice != "none"


# ---- the Responses API (POST /v1/responses): translated to a chat request by serving/api/admit.py ----------
#
# The server keeps nothing: `previous_response_id` and `conversation` (which need a stored response) are refused
# with a 400 that says so; send the earlier items in `input` instead.

NOTHING_STORED = ("this server stores no responses; send the earlier output items (messages, function_call and "
                  "function_call_output items) in input instead")
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class InputTextPart(ApiBody):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(ApiBody):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputTextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(ApiBody):
    type: Literal["function_call"]
    call_id: str = Field(..., min_length=1)
    name: str = Field(..., min_length=1)
    arguments: str


class FunctionCallOutputItem(ApiBody):
    type: Literal["function_call_output"]
    call_id: str = Field(..., min_length=1)
    output: str | list[InputTextPart]

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem
_ITEM_TYPES: dict[str, type[ApiBody]] = {"message": InputMessage, "function_call": FunctionCallItem,
                                       "function_call_output": FunctionCallOutputItem}


class FunctionTool(ApiBody):
    type: Literal["function"]
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(JsonSchemaFormat):
    """text.format: chat's json_schema object flattened beside its type, and its schema required."""

    type: Literal["text", "json_object", "json_schema"]
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # type: ignore[assignment]

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("type json_schema needs a schema")
        return self


class TextConfig(ApiBody):
    format: TextFormat | None = None  # verbosity: a hint, ignored


class ResponsesRequest(RefusingBody):
    refused_fields: ClassVar[dict[str, str]] = {
        "previous_response_id": NOTHING_STORED,
        "conversation": NOTHING_STORED,
        "prompt": "stored prompt templates live on OpenAI's platform; send the text in input",
        "background": "background responses need stored responses to poll; this server stores none",
        "moderation": "the server runs no moderation model; moderate the input and output before and after",
        "context_management": "the server does not compact conversations",
    }

    model: str = Field(..., min_length=1)
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=TEMPERATURE_RANGE[0], le=TEMPERATURE_RANGE[1])
    top_p: float | None = Field(None, gt=TOP_P_RANGE[0], le=TOP_P_RANGE[1])
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include: list[str] | None = None
    stream: bool | None = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # extensions, as on chat: the seed of the request's draws (docs/server.md), top-k sampling
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    top_k: int | None = Field(None, ge=MIN_TOP_K)

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, value: Any) -> Any:
        """Each item by its type (a message may leave it out); an item of another type is refused by name."""
        if not isinstance(value, list):
            return value
        if not value:
            raise ValueError("input is empty")
        items = []
        for i, item in enumerate(value):
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind not in _ITEM_TYPES:
                raise ValueError(f"item {i} has type {kind!r}; this server takes message, function_call and "
                                 "function_call_output items (text only)")
            items.append(_ITEM_TYPES[kind].model_validate(item))
        return items

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        for tool in value or []:
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tool type {kind!r} is not supported: the server runs function tools only")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, value: Any) -> Any:
        return check_tool_choice(value, '{"type": "function", "name": ...}')

    @field_validator("truncation", mode="before")
    @classmethod
    def _no_truncation(cls, value: Any) -> Any:
        if value == "auto":
            raise ValueError("auto is not supported: the server never drops input; an input over the context "
                             "length is a 400")
        return value

    @field_validator("input")
    @classmethod
    def _some_text(cls, value: str | list[InputItem]) -> str | list[InputItem]:
        if value == "":
            raise ValueError("input is empty")
        return value

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or []) or self.top_logprobs is not None
