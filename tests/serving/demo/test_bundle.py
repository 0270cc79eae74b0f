"""The committed demo pair loads with plain transformers and behaves like a target/draft pair."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from serving.demo import draft_path, target_path
from serving.demo.training import DRAFT_SHAPE

MAX_BUNDLE_MB = 40


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(target_path()))


@pytest.mark.parametrize("path", [target_path(), draft_path()], ids=["target", "draft"])
def test_model_dir_has_standard_hf_files(path):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).is_file(), f"{path / name} missing"


def test_target_shape_exercises_gqa():
    cfg = AutoConfig.from_pretrained(str(target_path()))
    assert cfg.model_type == "llama"
    assert (cfg.num_hidden_layers, cfg.hidden_size) == (8, 256)
    assert cfg.num_attention_heads > cfg.num_key_value_heads


def test_draft_shape_and_shared_vocab():
    target = AutoConfig.from_pretrained(str(target_path()))
    draft = AutoConfig.from_pretrained(str(draft_path()))
    assert (draft.num_hidden_layers, draft.hidden_size, draft.intermediate_size) == (
        DRAFT_SHAPE.layers, DRAFT_SHAPE.hidden, DRAFT_SHAPE.intermediate
    )
    assert draft.tie_word_embeddings == DRAFT_SHAPE.tied
    assert draft.vocab_size == target.vocab_size
    assert draft.eos_token_id == target.eos_token_id


def test_pair_shares_one_tokenizer():
    a = json.loads((target_path() / "tokenizer.json").read_text())
    b = json.loads((draft_path() / "tokenizer.json").read_text())
    assert a["model"]["vocab"] == b["model"]["vocab"]


def test_bundle_fits_size_budget():
    total = sum(f.stat().st_size for p in (target_path(), draft_path()) for f in p.iterdir())
    assert total / 2**20 <= MAX_BUNDLE_MB


@pytest.mark.parametrize("path", [target_path(), draft_path()], ids=["target", "draft"])
def test_model_loads_and_gives_finite_logits(path, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = tokenizer("def add(a, b):\n    return", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


def test_target_learned_python(tokenizer):
    model = AutoModelForCausalLM.from_pretrained(str(target_path()), dtype=torch.float32).eval()
    ids = tokenizer("import os\nimport sys\n\n\ndef main(", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert ")" in tokenizer.decode(out[0, ids.shape[1] :])
