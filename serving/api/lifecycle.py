"""Start-up in the background, so /health and /ready answer while it runs:
verify (or pull) the weights → load the engine → one warm-up generation → ready.

Any failure leaves the server up but never ready, with /ready naming the cause (for weights:
the file). The model loads here, never at import time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from serving.api.settings import Settings
from serving.api.state import Engine, ServerState
from serving.api.tokenize import TokenizerPool
from serving.config import ServerConfig
from serving.engine.types import GenerationRequest, SamplingParams
from serving.weights import WeightsError, ensure_local, verify_dir

logger = logging.getLogger(__name__)

EngineFactory = Callable[[Settings], Engine]
WARMUP_TOKENS = 4


def verify_weights(config: ServerConfig) -> None:
    """Pull ``service.weights_uri`` into ``model.path`` if set; verify the target and the draft."""
    ensure_local(Path(config.model.path), config.service.weights_uri)
    spec = config.speculative
    if spec.uses_draft_model and spec.draft_model:
        try:
            verify_dir(Path(spec.draft_model))
        except WeightsError as exc:
            raise WeightsError(f"draft model: {exc}") from exc


def build_engine(settings: Settings) -> Engine:
    """The real engine, configured from the server config file."""
    from serving.engine import AsyncEngine, EngineConfig

    engine_config = EngineConfig.from_server_config(settings.config)
    engine: Engine = AsyncEngine.from_config(engine_config)
    return engine


async def warm_up(engine: Engine) -> None:
    tokenizer = engine.tokenizer
    prompt = list(tokenizer.encode("Hello", add_special_tokens=True)) if tokenizer is not None else [1]
    request = GenerationRequest("warmup", prompt or [1], SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS))
    async for output in engine.generate(request):
        if output.finished:
            break


async def start_serving(state: ServerState, factory: EngineFactory) -> None:
    settings = state.settings
    try:
        state.phase = "verifying weights"
        await asyncio.to_thread(verify_weights, settings.config)
        state.phase = "loading model"
        engine = await asyncio.to_thread(factory, settings)
        await engine.start()
        limits = settings.config.scheduler
        # as many prompts may wait for the tokenizer as the engine would admit (running + queued)
        state.tokenizers = TokenizerPool(engine.tokenizer, limits.max_input_len,
                                         max_pending=max(limits.max_concurrency + limits.max_queue, 2))
        state.engine = engine
        if getattr(engine, "device_type", None) == "cuda" or _cuda_in_use(settings):
            state.metrics.enable_gpu()
        state.phase = "warming up"
        await warm_up(engine)
        state.phase = "ready"
        logger.info("ready: serving %s from %s", settings.model_name, settings.config.model.path)
    except WeightsError as exc:
        state.failure = f"weights verification failed: {exc}"
        logger.error("not ready: %s", state.failure)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        state.failure = f"start-up failed during {state.phase}: {exc}"
        logger.exception("not ready: start-up failed during %s", state.phase)


def _cuda_in_use(settings: Settings) -> bool:
    if settings.config.model.device == "cpu":
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False
