"""The rebuild scripts run end to end on a tiny configuration (a few steps, tmp dirs)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from serving.demo import build_tokenizer, distill_draft, evaluate, train_target

TINY = ["--tiny", "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--max-files", "4", "--threads", "1"]


def test_tokenizer_target_draft_and_evaluate_rebuild(tmp_path, capsys):
    tok_dir, target_dir, draft_dir = tmp_path / "tok", tmp_path / "target", tmp_path / "draft"
    build_tokenizer.main(["--out", str(tok_dir), "--vocab-size", "300", "--max-files", "4"])
    assert len(AutoTokenizer.from_pretrained(str(tok_dir))) == 300

    train_target.main([*TINY, "--tokenizer", str(tok_dir), "--out", str(target_dir)])
    continued = tmp_path / "continued"
    train_target.main([*TINY, "--tokenizer", str(tok_dir), "--init-from", str(target_dir), "--out", str(continued)])
    assert json.loads((continued / "training.json").read_text())["continued_from"]["steps"] == 2
    distill_draft.main([*TINY, "--target", str(target_dir), "--out", str(draft_dir)])
    grown = tmp_path / "grown"  # the tiny draft (2 layers) grown to 3, continued for two steps
    distill_draft.main([*TINY, "--target", str(target_dir), "--out", str(grown), "--grow-from", str(draft_dir),
                        "--layers", "3"])
    record = json.loads((grown / "training.json").read_text())
    assert record["layers"] == 3 and record["grown_from"]["steps"] == 2
    assert AutoModelForCausalLM.from_pretrained(str(grown)).config.num_hidden_layers == 3
    for path in (target_dir, draft_dir):
        model = AutoModelForCausalLM.from_pretrained(str(path))
        assert model.config.vocab_size == 300
        assert json.loads((path / "training.json").read_text())["steps"] == 2
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*.old"))

    capsys.readouterr()
    evaluate.main(
        [
            "--target",
            str(target_dir),
            "--draft",
            str(draft_dir),
            "--max-windows",
            "2",
            "--new-tokens",
            "2",
            "--json-only",
            "--threads",
            "1",
        ]
    )
    result = json.loads(capsys.readouterr().out)
    assert 0.0 <= result["greedy_top1_agreement"] <= 1.0
    assert result["target"]["perplexity"] > 1 and torch.isfinite(torch.tensor(result["draft"]["loss"]))


def test_a_grown_draft_starts_as_the_draft_it_grew_from(tmp_path):
    """New layers start as the identity and a kept MLP is copied whole: same logits before any training."""
    from transformers import LlamaForCausalLM

    from serving.demo import target_path
    from serving.demo.training import Shape, llama_config

    tokenizer = AutoTokenizer.from_pretrained(str(target_path()))
    torch.manual_seed(0)
    source = LlamaForCausalLM(llama_config(Shape(1, 32, 4, 2, 48), tokenizer)).eval()
    tokens = torch.randint(0, len(tokenizer), (1, 24))
    for intermediate, exact in ((48, True), (32, False)):
        grown = distill_draft.grow_draft(source, Shape(3, 32, 4, 2, intermediate), tokenizer).eval()
        with torch.no_grad():
            want, got = source(tokens).logits, grown(tokens).logits
        if exact:
            torch.testing.assert_close(got, want)
        else:  # a narrowed MLP keeps its strongest units only: close, not equal
            assert not torch.allclose(got, want)
    with pytest.raises(ValueError, match="keeps the width"):
        distill_draft.grow_draft(source, Shape(2, 64, 4, 2, 48), tokenizer)
