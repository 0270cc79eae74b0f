"""The model runner runs one scheduled step: the forward of every scheduled token, then a token and its logprobs
for each request that reaches its end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from serving.engine.batch import SequenceInput
from serving.engine.types import GenerationRequest, SamplingParams


def test_execute_samples_the_next_token_of_each_scheduled_request(kit: Any, llama_dir: Path) -> None:
    engine = kit.make_engine(llama_dir)
    prompts = kit.random_prompts([5, 9], seed=4)
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerationRequest(str(i), prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=2)))
    sched = engine.scheduler.schedule()
    sampled, logprobs = engine.runner.execute(sched, engine.blocks)

    logits = kit.PagedRunner(llama_dir).step(prompts, [(0, 0, 5), (1, 0, 9)])  # every token's, both prompts
    last = {"0": logits[4], "1": logits[5 + 8]}
    assert sampled == {rid: [int(row.argmax())] for rid, row in last.items()}
    for rid, row in last.items():
        (chosen,) = logprobs[rid]
        expected = torch.log_softmax(row.double(), dim=-1)
        assert chosen.token_id == sampled[rid][0]
        assert chosen.logprob == pytest.approx(float(expected[chosen.token_id]), abs=1e-4)
        assert [t for t, _ in chosen.top_logprobs] == expected.topk(2).indices.tolist()


def test_run_forward_is_the_models_forward_until_steps_are_compiled(kit: Any, llama_dir: Path) -> None:
    engine = kit.make_engine(llama_dir)
    runner = engine.runner
    assert runner.compiled is None and runner.cache.num_blocks == engine.blocks.num_blocks
    engine.blocks.allocate("a", 6)
    batch = runner.builder.build([SequenceInput([3, 1, 4, 1, 5, 9], 0, engine.blocks.block_table("a"), [5])])
    with torch.inference_mode():
        hidden = runner.run_forward(batch)
        again = runner.model(batch, runner.cache)
    torch.testing.assert_close(hidden, again)
