"""Request bodies of the OpenAI-compatible endpoints. Unknown fields are ignored, like OpenAI's own
SDK extras; fields we accept but cannot honour are refused with a 400 naming them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

MAX_STOP_SEQUENCES = 4
MAX_LOGPROBS = 20
# Errors these schemas raise with their own code; the message names the field itself.
EMPTY_PROMPT = "empty_prompt"
INVALID_TEXT = "invalid_text"
SCHEMA_ERROR_CODES = frozenset({EMPTY_PROMPT, INVALID_TEXT})
# torch.Generator.manual_seed takes a signed 64-bit seed; a bigger one used to crash the engine loop.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


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


class _Body(BaseModel):
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


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    model: str = Field(..., min_length=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    ignore_eos: bool = False  # extension (benchmarks): generate exactly max_tokens
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("only n=1 is supported")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, value: float | None) -> float | None:
        if value:
            raise ValueError("penalties are not supported; use 0")
        return value

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
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("echo is not supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return value

    @field_validator("prompt")
    @classmethod
    def _single_prompt(
        cls, value: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        single = value
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError("batched prompts are not supported; send one prompt per request")
            single = value[0]
        if not single:
            raise PydanticCustomError(EMPTY_PROMPT, "prompt is empty")
        return value

    @property
    def single_prompt(self) -> str | list[int]:
        value = self.prompt
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            return value[0]  # type: ignore[return-value]
        return value  # type: ignore[return-value]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, object]] | None = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list[dict[str, object]] | None) -> list[dict[str, object]] | None:
        if value:
            raise ValueError("tool calling is not supported")
        return value

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
