"""The rebuild scripts run end to end on a tiny configuration (a few steps, tmp dirs)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from serving.demo import build_tokenizer, distill_draft, evaluate, target_outputs, train_target

TINY = ["--tiny", "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--max-files", "4", "--threads", "1"]


@pytest.mark.slow  # end to end: trains, distils and evaluates a tiny pair
def test_tokenizer_target_draft_and_evaluate_rebuild(tmp_path, capsys):
    tok_dir, target_dir, draft_dir = tmp_path / "tok", tmp_path / "target", tmp_path / "draft"
    build_tokenizer.main(["--out", str(tok_dir), "--vocab-size", "300", "--max-files", "4"])
    assert len(AutoTokenizer.from_pretrained(str(tok_dir))) == 300

    train_target.main([*TINY, "--tokenizer", str(tok_dir), "--out", str(target_dir)])
    continued = tmp_path / "continued"
    train_target.main([*TINY, "--tokenizer", str(tok_dir), "--init-from", str(target_dir), "--out", str(continued)])
    assert json.loads((continued / "training.json").read_text())["continued_from"]["steps"] == 2
    distill_draft.main([*TINY, "--target", str(target_dir), "--out", str(draft_dir)])
    grown = tmp_path / "grown"  # the tiny draft (2 layers, tied) grown to 3 with its own lm_head, two steps
    distill_draft.main([*TINY, "--target", str(target_dir), "--out", str(grown), "--grow-from", str(draft_dir),
                        "--layers", "3", "--no-tied"])
    record = json.loads((grown / "training.json").read_text())
    assert record["shape"]["layers"] == 3 and record["shape"]["tied"] is False
    assert record["grown_from"]["steps"] == 2
    config = AutoModelForCausalLM.from_pretrained(str(grown)).config
    assert (config.num_hidden_layers, config.tie_word_embeddings) == (3, False)
    with pytest.raises(SystemExit):  # --init-from keeps the checkpoint's shape; reshaping is --grow-from's job
        distill_draft.main([*TINY, "--init-from", str(draft_dir), "--layers", "3"])

    # a token stream saved elsewhere (int16, as carried to a GPU host) instead of this machine's stdlib
    stream = tmp_path / "tokens.pt"
    torch.save(torch.randint(0, 300, (5000,), generator=torch.Generator().manual_seed(0)).to(torch.int16), stream)
    from_stream = tmp_path / "from-stream"
    distill_draft.main([*TINY, "--target", str(target_dir), "--out", str(from_stream), "--corpus-tokens", str(stream)])
    record = json.loads((from_stream / "training.json").read_text())
    assert record["corpus_tokens"] == {"file": "tokens.pt", "tokens": 5000} and record["device"] == "cpu"
    torch.save(torch.tensor([1, 2, 300]), tmp_path / "wide.pt")  # 300 is past the 300-token vocabulary
    (tmp_path / "text.pt").write_text("not a tensor")
    for bad, says in (("wide.pt", "outside the target's vocabulary"), ("text.pt", "cannot read a token stream"),
                      ("missing.pt", "cannot read a token stream")):
        with pytest.raises(SystemExit, match=says):
            distill_draft.main([*TINY, "--target", str(target_dir), "--out", str(tmp_path / "bad"),
                                "--corpus-tokens", str(tmp_path / bad)])
    assert not (tmp_path / "bad").exists()

    # the target's own greedy continuations, mixed into the draft's batches
    outputs = tmp_path / "outputs.pt"
    target_outputs.main(["--target", str(target_dir), "--out", str(outputs), "--windows", "6", "--prompt-len", "9",
                         "--new-tokens", "24", "--concurrency", "4", "--corpus-tokens", str(stream)])
    rows = torch.load(outputs)
    assert rows.shape == (6, 33) and rows.dtype == torch.int16
    prompt = rows[0, :9].tolist()  # each row is a prompt from the stream, then the target's greedy tokens
    with torch.no_grad():  # greedy by hand: eos is just another token here, as with ignore_eos
        model = AutoModelForCausalLM.from_pretrained(str(target_dir)).eval()
        ids = list(prompt)
        for _ in range(24):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert rows[0, 9:].tolist() == ids[9:]
    mixed = tmp_path / "mixed"
    distill_draft.main([*TINY, "--target", str(target_dir), "--out", str(mixed), "--corpus-tokens", str(stream),
                        "--target-outputs", str(outputs), "--target-outputs-share", "1.0"])
    record = json.loads((mixed / "training.json").read_text())
    assert record["target_outputs"] == {"file": "outputs.pt", "rows": 6, "row_tokens": 33, "per_batch": 2}
    with pytest.raises(SystemExit, match="shorter than --seq-len"):  # rows of 33 tokens, windows of 64 + 1
        distill_draft.main([*TINY, "--seq-len", "64", "--target", str(target_dir), "--out", str(tmp_path / "bad"),
                            "--target-outputs", str(outputs)])
    with pytest.raises(SystemExit, match="not a 2-D integer tensor"):
        distill_draft.main([*TINY, "--target", str(target_dir), "--out", str(tmp_path / "bad"),
                            "--target-outputs", str(stream)])
    assert not (tmp_path / "bad").exists()
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

