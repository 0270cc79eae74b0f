"""Where an engine step's time goes: Python (scheduling, batch metadata, bookkeeping), attention, matmuls
(the rest of the forward) and sampling — measured with perf_counter around the phases of a live engine.

`StepTimer` wraps a few bound methods of one engine instance for the duration of a `with` block and puts
them back afterwards; nothing in the engine knows about it. Wrapping costs a few microseconds per step
(one timer per layer call), small next to a step of milliseconds. On CUDA each timed phase synchronizes
the device first, so the split is true but the step runs slower than unprofiled.

    python    = step − forward − lm_head − sampling − drafting   (what no kernel does: the overhead to cut)
    attention = KV cache writes + gathers + SDPA, every layer (a decode step captured whole has its attention
                inside the graph: only its K/V write is counted here, the rest is in matmuls)
    matmuls   = forward + lm_head − attention  (projections, MLP, norms, RoPE, embeddings)
    sampling  = sampling, draft verification and logprobs
    drafting  = the draft proposer's forwards (speculative engines only)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from serving.engine.engine import LLMEngine


@dataclass
class StepBreakdown:
    concurrency: int
    steps: int
    step_ms: float  # mean wall time of one step
    python_ms: float  # scheduling, batch metadata, request bookkeeping: the step minus the phases below
    attention_ms: float  # KV cache writes, context gathers and SDPA, all layers
    matmuls_ms: float  # the rest of the forward and the lm_head (projections, MLP, norms, RoPE)
    sampling_ms: float  # sampling, verification of drafts, logprobs
    drafting_ms: float = 0.0  # draft proposals (speculative engines)

    def share(self, phase: str) -> float:
        """Fraction of the step spent in phase ("python", "attention", "matmuls", "sampling", "drafting")."""
        return float(getattr(self, f"{phase}_ms")) / self.step_ms if self.step_ms else 0.0


class StepTimer:
    """Accumulates seconds per phase of the engine's steps while active (see the module docstring)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.seconds: dict[str, float] = {}
        self._sync = engine.device.type == "cuda"
        self._restore: list[tuple[Any, str]] = []
        self._steps_at_start = engine.steps_total

    def __enter__(self) -> StepTimer:
        engine = self.engine
        self._steps_at_start = engine.steps_total
        targets: list[tuple[Any, str, str]] = [
            (engine, "step", "step"),
            (engine.runner, "run_forward", "forward"),
            (engine.model, "compute_logits", "lm_head"),
            (engine.runner.cache, "write", "attention"),
            (engine.runner.cache, "write_layers", "attention"),
            (engine.runner, "sample_or_verify", "sampling"),
            (engine.runner, "logprobs_of", "sampling"),
        ]
        targets += [(layer.attention, "attend_group", "attention") for layer in engine.model.layers]
        if engine.speculator is not None:
            targets.append((engine.speculator, "propose_next", "drafting"))
        for obj, name, phase in targets:
            self._wrap(obj, name, phase)
        return self

    def __exit__(self, *exc: object) -> None:
        for obj, name in reversed(self._restore):
            delattr(obj, name)  # the instance attribute goes; the class's method shows through again
        self._restore.clear()

    def _wrap(self, obj: Any, name: str, phase: str) -> None:
        inner: Callable[..., Any] = getattr(obj, name)
        seconds, sync = self.seconds, self._sync

        def timed(*args: Any, **kwargs: Any) -> Any:
            if sync:
                torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if sync:
                    torch.cuda.synchronize()
                seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - start

        setattr(obj, name, timed)
        self._restore.append((obj, name))

    def breakdown(self, concurrency: int) -> StepBreakdown:
        s = self.seconds
        steps = max(self.engine.steps_total - self._steps_at_start, 1)
        per_step = 1e3 / steps
        step = s.get("step", 0.0)
        forward, lm_head, attention = s.get("forward", 0.0), s.get("lm_head", 0.0), s.get("attention", 0.0)
        sampling, drafting = s.get("sampling", 0.0), s.get("drafting", 0.0)
        return StepBreakdown(
            concurrency=concurrency,
            steps=steps,
            step_ms=step * per_step,
            python_ms=max(step - forward - lm_head - sampling - drafting, 0.0) * per_step,
            attention_ms=attention * per_step,
            matmuls_ms=max(forward + lm_head - attention, 0.0) * per_step,
            sampling_ms=sampling * per_step,
            drafting_ms=drafting * per_step,
        )


def profile_steps(engine: LLMEngine, run: Callable[[], Any], concurrency: int) -> StepBreakdown:
    """Run `run()` (which drives the engine to completion) under a StepTimer; the mean split of its steps."""
    timer = StepTimer(engine)
    with timer:
        run()
    return timer.breakdown(concurrency)
