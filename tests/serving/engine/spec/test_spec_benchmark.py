from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from serving.engine.spec.benchmark import expected_speedup, measure_alpha
from serving.engine.types import SamplingParams


def test_alpha_is_one_for_a_draft_equal_to_the_target_and_lower_for_another(
    kit: Any, llama_dir: Path, qwen2_dir: Path
) -> None:
    engine = kit.make_engine(llama_dir)
    prompts = kit.random_prompts([12, 30, 7], seed=3)
    outputs = kit.run_to_completion(engine, prompts, [SamplingParams(temperature=0.0, max_tokens=16,
                                                                     ignore_eos=True)] * 3)
    assert measure_alpha(engine.model, prompts, outputs, 4) == [1.0] * 4
    other = kit.make_engine(qwen2_dir).model  # same vocabulary, different weights
    alpha = measure_alpha(other, prompts, outputs, 4)
    assert len(alpha) == 4 and all(0.0 <= a <= 1.0 for a in alpha) and alpha[0] < 0.5


def test_expected_speedup_at_alpha() -> None:
    ceiling = {"target_decode_step_s": 1.0, "target_verify_step_s": 1.5, "draft_step_s": 0.25}
    # k = 2, alpha 0.5 then 0.5: 1 + 0.5 + 0.25 tokens per round, a round costs 1.5 + 2 * 0.25
    assert expected_speedup([0.5, 0.5, 0.9], 2, ceiling) == pytest.approx(1.75 / 2.0)
    assert expected_speedup([1.0, 1.0], 2, ceiling) == pytest.approx(3 / 2.0)
