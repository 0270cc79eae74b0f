from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from serving.engine.loader import read_model_args
from serving.engine.model import ModelArgs, UnsupportedModelError

TOL = 1e-4


def reference_logits(model_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [ref(torch.tensor([p])).logits[0] for p in prompts]


def check_prefill_decode_mixed(kit: Any, model_dir: Path) -> None:
    prompts = kit.random_prompts([37, 5, 20, 2])
    refs = reference_logits(model_dir, prompts)
    runner = kit.PagedRunner(model_dir)
    # step 1: prefill chunks of different lengths; step 2: mixed (chunk + decodes); step 3: decodes only;
    # step 4: a multi-token "verify" slice next to a single decode token
    layout = [
        [(0, 0, 20), (1, 0, 4), (2, 0, 3), (3, 0, 1)],
        [(0, 20, 10), (1, 4, 1), (2, 3, 1), (3, 1, 1)],
        [(0, 30, 1), (2, 4, 1)],
        [(0, 31, 6), (2, 5, 1)],
        [(2, 6, 14)],
    ]
    for step in layout:
        got = runner.step(prompts, step)
        want = torch.cat([refs[sid][start : start + n] for sid, start, n in step])
        assert got.shape == want.shape
        assert (got - want).abs().max().item() < TOL, step


def test_llama_logits_match_transformers(kit: Any, llama_dir: Path) -> None:
    check_prefill_decode_mixed(kit, llama_dir)


def test_qwen2_logits_match_transformers_with_qkv_bias(kit: Any, qwen2_dir: Path) -> None:
    assert read_model_args(qwen2_dir).qkv_bias
    check_prefill_decode_mixed(kit, qwen2_dir)


def test_mistral_tied_embeddings_sharded_checkpoint(kit: Any, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    src = kit.save_tiny_model(tmp_path / "src", "mistral", tie_word_embeddings=True, sliding_window=None)
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    check_prefill_decode_mixed(kit, tmp_path / "sharded")


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        {"rope_type": "dynamic", "factor": 2.0},
    ],
    ids=lambda r: r["rope_type"],
)
def test_rope_scaling_variants_match_transformers(kit: Any, tmp_path: Path, rope: dict) -> None:
    model_dir = kit.save_tiny_model(tmp_path, "llama", rope_scaling=dict(rope, rope_theta=10000.0))
    check_prefill_decode_mixed(kit, model_dir)


def test_unsupported_architecture_is_named(kit: Any, tmp_path: Path) -> None:
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        read_model_args(tmp_path)


def test_model_args_from_hf_config_reads_gqa_and_eos() -> None:
    args = ModelArgs.from_hf_config({
        "model_type": "llama", "vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 128, "eos_token_id": [3, 4],
    })
    assert (args.n_rep, args.head_dim, args.eos_token_ids) == (4, 8, [3, 4])


@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 0.08), (torch.float16, 0.01)], ids=["bf16", "fp16"])
def test_half_precision_logits_track_transformers_in_the_same_dtype(
    kit: Any, llama_dir: Path, dtype: torch.dtype, tol: float
) -> None:
    from transformers import AutoModelForCausalLM

    prompt = kit.random_prompts([30])
    runner = kit.PagedRunner(llama_dir, dtype=dtype)
    got = torch.cat([runner.step(prompt, [(0, 0, 20)]), runner.step(prompt, [(0, 20, 10)])])
    ref = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=dtype).eval()
    with torch.no_grad():
        want = ref(torch.tensor(prompt)).logits[0].float()
    assert (got - want).abs().max().item() < tol  # a few ulps at logits of magnitude ~3


def test_eos_ids_from_generation_config_are_added(kit: Any, tmp_path: Path) -> None:
    model_dir = kit.save_tiny_model(tmp_path, "llama", eos_token_id=3)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 7]}))
    assert read_model_args(model_dir).eos_token_ids == [3, 7]
