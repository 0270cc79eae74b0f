"""4. Speculative decoding A/B: same host, same parameters, on vs off, and the written decision.

Guide-deploy 七.3: enable only if single-request P99 latency drops clearly and throughput does not
drop noticeably; otherwise turn it off. Decisions per prompt set and concurrency level are in the
report (infra/validation/abtest.py has the rule and how the arms are alternated).
"""

from __future__ import annotations

import warnings
from typing import Any

import httpx
import pytest

from infra.validation.greedy import classify, token_steps
from infra.validation.loadgen import auth_headers, load_workloads

pytestmark = pytest.mark.launch


def test_ab_cell_completed_every_request_on_both_arms(ab_result: Any, ab_cell: tuple[str, int]) -> None:
    on, off = ab_result.cells[ab_cell]
    for label, arm in (("on", on), ("off", off)):
        sent = sum(len(p.records) for p in arm.phases)
        assert sent > 0 and arm.errors() == 0, f"spec {label}: {arm.errors()} of {sent} requests failed"


def test_ab_decision_states_numbers_for_every_cell(ab_result: Any, ab_cell: tuple[str, int]) -> None:
    decision = next(d for d in ab_result.decisions() if (d.prompt_set, d.concurrency) == ab_cell)
    assert decision.p99_gain is not None and decision.throughput_change is not None, decision.reason
    assert decision.reason


def test_greedy_output_is_identical_with_and_without_speculation(ab_arms: tuple[str, str, str],
                                                                 api_key: str | None, prompt_set: str,
                                                                 model_name: str, stack: Any) -> None:
    """Identical token for token; where the arms part, the spec-off arm's log-probabilities at that token say
    whether it was a near-tie within the serving precision's rounding (bf16/fp16: verify and decode rows round
    differently) or speculation changed the output (infra/validation/greedy.py)."""
    workload = load_workloads([prompt_set], 32)[0]
    path, body = workload.body(model_name, stream=False)
    body.update({"logprobs": True, "top_logprobs": 5} if "messages" in body else {"logprobs": 5})
    steps = []
    for url in ab_arms[:2]:
        response = httpx.post(f"{url}{path}", json=body, headers=auth_headers(api_key), timeout=300)
        assert response.status_code == 200, response.text[:300]
        steps.append(token_steps(response.json()))
    on, off = steps
    divergence = classify(off, on, stack.model.dtype)
    if divergence is None:
        return
    assert divergence.rounding, f"speculation changed greedy output (it must be lossless): {divergence.message}"
    warnings.warn(f"greedy texts part at a near-tie, within rounding: {divergence.message}", stacklevel=1)


def test_deployed_setting_follows_the_ab_decision(ab_result: Any, launch_run: Any, stack: Any, profile: Any) -> None:
    if profile.name == "quick":
        pytest.skip("the quick A/B is too short to overrule the stack's setting; its decision is in the report")
    recommended = launch_run.recommendation["enabled"]
    assert stack.speculative.enabled == recommended, (
        f"stack has speculative.enabled={stack.speculative.enabled}, the A/B recommends {recommended}: "
        f"{launch_run.recommendation['reason']}")
