"""lm-evaluation-harness's `local-completions` model runs a loglikelihood task against the server, and its
log-likelihoods are the reference model's. Runs where lm_eval is installed (it is not a project dependency:
`pip install "lm_eval[api]" -c <constraints pinning torch>`); the exact request shape it sends is also tested
without it in test_openai_parity.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

DOCS = [
    {"context": "def add(a, b):\n    return", "choices": [" a + b", " a - b", " None"], "label": 0},
    {"context": "import os\nimport", "choices": [" sys", " os", " json"], "label": 0},
    {"context": "for i in range(10):\n   ", "choices": [" print(i)", " pass", " break"], "label": 0},
    {"context": "class Stack:\n    def __init__(self):\n        self.items =", "choices": [" []", " {}"],
     "label": 0},
]


def write_task(directory: Path) -> str:
    data = directory / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (directory / "task.yaml").write_text(
        "task: specdeploy_tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: label\n"
        "metric_list:\n  - metric: acc\n"
    )
    return "specdeploy_tiny_mc"


def reference_loglikelihood(model: Any, context: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logprobs = model(ids).logits[0].float().log_softmax(-1)
    rows = torch.arange(len(context) - 1, len(context) + len(continuation) - 1)
    return float(logprobs[rows, torch.tensor(continuation)].sum())


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [1, 4])  # 4: several prompts in one request
def test_local_completions_loglikelihood_task_matches_the_reference_model(
    server: Any, api_keys: dict[str, str], tiny_chat_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    batch_size: int,
) -> None:
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("OPENAI_API_KEY", api_keys["alice"])
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    task = write_task(tmp_path)
    lm = LocalCompletionsAPI(base_url=f"{server.base_url}/v1/completions", model="tiny",
                             tokenizer=str(tiny_chat_model), tokenizer_backend="huggingface",
                             tokenized_requests=True, num_concurrent=1, max_retries=1, batch_size=batch_size)
    results = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=TaskManager(include_path=str(tmp_path)),
                                      log_samples=True)
    samples = results["samples"][task]
    assert len(samples) == len(DOCS)
    reference = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32).eval()
    checked = 0
    for sample in samples:
        for (context, continuation), response in zip(sample["arguments"], sample["resps"], strict=True):
            loglikelihood, _is_greedy = response[0]
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            expected = reference_loglikelihood(reference, context_ids, continuation_ids)
            assert loglikelihood == pytest.approx(expected, abs=1e-3)
            checked += 1
    assert checked == sum(len(d["choices"]) for d in DOCS)
    assert 0.0 <= results["results"][task]["acc,none"] <= 1.0
