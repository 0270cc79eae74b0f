"""The serving engine: a Llama-family model on a paged KV cache with continuous batching.

The request/response types import without torch; the engine classes load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from serving.engine.config import EngineConfig, SpeculativeConfig
from serving.engine.types import (
    EngineDeadError,
    EngineStats,
    FinishReason,
    GenerationRequest,
    RequestOutput,
    RequestRejected,
    SamplingParams,
    SpecStats,
    TokenLogprobs,
)

if TYPE_CHECKING:
    from serving.engine.async_engine import AsyncEngine
    from serving.engine.engine import LLMEngine
    from serving.engine.model import UnsupportedModelError

_LAZY = {
    "AsyncEngine": "serving.engine.async_engine",
    "LLMEngine": "serving.engine.engine",
    "UnsupportedModelError": "serving.engine.model",
}

__all__ = [
    "AsyncEngine",
    "EngineConfig",
    "EngineDeadError",
    "EngineStats",
    "FinishReason",
    "GenerationRequest",
    "LLMEngine",
    "RequestOutput",
    "RequestRejected",
    "SamplingParams",
    "SpecStats",
    "SpeculativeConfig",
    "TokenLogprobs",
    "UnsupportedModelError",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
