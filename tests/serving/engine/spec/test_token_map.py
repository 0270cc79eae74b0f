"""A draft restricted to a token map (serving.engine.spec.token_map, `speculative.draft_token_map`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from serving.config import SpeculativeSection
from serving.engine.config import SpeculativeConfig
from serving.engine.spec import token_map as token_map_module
from serving.engine.spec.draft import DraftModelProposer
from serving.engine.spec.token_map import (
    UNMAPPED_LOGIT,
    TokenMapError,
    TokenMapHead,
    apply_token_map,
    most_frequent,
    read_token_map,
    token_map_path,
    write_token_map,
)
from serving.engine.types import SamplingParams

MAPPED = sorted(set(range(0, 128, 3)) | {1, 2, 64, 127})  # the tiny models' vocabulary is 128


@pytest.fixture(scope="module")
def mapped_draft(kit: Any, llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target's own weights as the draft (so it agrees with the target wherever the map lets it), with a map."""
    directory = tmp_path_factory.mktemp("mapped") / "draft"
    shutil.copytree(llama_dir, directory)
    (directory / "token_map.json").write_text(json.dumps(list(reversed(MAPPED))))
    return directory


@pytest.mark.parametrize("content, problem", [
    (None, "does not exist"),
    ("[1, 2,", "not readable JSON"),
    ("{}", "non-empty JSON list"),
    ("[]", "non-empty JSON list"),
    ('[1, "2"]', "'2', which is not a token id"),
    ("[1, true]", "True, which is not a token id"),
    ("[1, 2.0]", "2.0, which is not a token id"),
    ("[0, 128, 300]", "token id 128 is outside the draft's vocabulary of 128 (2 such ids)"),
    ("[-1]", "token id -1 is outside"),
    ("[5, 6, 5]", "lists 1 token id(s) twice"),
])
def test_a_bad_token_map_is_refused_naming_the_file_and_the_problem(tmp_path: Path, content: str | None,
                                                                    problem: str) -> None:
    path = tmp_path / "token_map.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(TokenMapError) as info:
        read_token_map(path, 128)
    assert str(path) in str(info.value) and problem in str(info.value)


def test_a_token_map_reads_as_sorted_ids(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text("[9, 0, 4]")
    assert read_token_map(path, 10).tolist() == [0, 4, 9]


@pytest.mark.parametrize("name", ["/abs/map.json", "../map.json", "maps/../../map.json", "", "maps\\map.json"])
def test_the_config_refuses_a_token_map_outside_the_draft_directory(name: str) -> None:
    with pytest.raises(ValidationError, match="draft_token_map"):
        SpeculativeSection(enabled=True, method="draft", draft_model="/d", draft_token_map=name)
    with pytest.raises(TokenMapError, match="inside the draft model's directory"):
        token_map_path("/d", name)


def test_a_token_map_may_sit_in_a_subdirectory_of_the_draft() -> None:
    section = SpeculativeSection(enabled=True, method="draft", draft_model="/d", draft_token_map="maps/code.json")
    assert section.draft_token_map == "maps/code.json"
    assert token_map_path("/d", "maps/code.json") == Path("/d/maps/code.json")
    assert SpeculativeSection().draft_token_map == "auto"  # the draft's own token_map.json where it ships one


def test_the_head_computes_the_mapped_logits_and_leaves_the_rest_out() -> None:
    g = torch.Generator().manual_seed(0)
    full = nn.Linear(16, 40, bias=False)
    nn.init.normal_(full.weight, generator=g)
    ids = torch.tensor([0, 3, 7, 8, 39])
    head = TokenMapHead(full.weight, ids)
    x = torch.randn(2, 5, 16, generator=g)
    with torch.inference_mode():
        got, want = head(x), full(x)
    assert got.shape == (2, 5, 40)
    torch.testing.assert_close(got[..., ids], want[..., ids])
    outside = torch.ones(40, dtype=torch.bool)
    outside[ids] = False
    assert (got[..., outside] == UNMAPPED_LOGIT).all()
    assert set(got.argmax(-1).flatten().tolist()) <= set(ids.tolist())
    probs = torch.softmax(got, -1)
    assert (probs[..., outside] == 0).all()  # exactly 0 in fp32, as -inf would give
    assert head.weight.shape == (5, 16) and not head.weight.requires_grad


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, top_p=0.9),
                                    SamplingParams(temperature=1.0, presence_penalty=1.5, logit_bias={5: 2.0})])
def test_a_row_whose_mapped_tokens_a_grammar_forbids_still_has_a_distribution(params: SamplingParams) -> None:
    """UNMAPPED_LOGIT is finite: when a grammar masks every mapped token, the draft's row keeps a maximum among
    the tokens the grammar allows (uniform there) instead of turning into NaN, as -inf everywhere would."""
    from serving.engine.logits import adjust_logits
    from serving.engine.sampling import SamplingRows, greedy_tokens, logits_to_probs

    weight = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
    logits = TokenMapHead(weight, torch.tensor([0, 1, 2, 3]))(torch.randn(1, 4)).float()
    logits[:, :4] = float("-inf")  # the grammar allows only 4..7, none of them mapped
    logits = adjust_logits(logits, [params], [[5, 6]])
    probs = logits_to_probs(logits, SamplingRows.from_params([params], 8, torch.device("cpu")))
    assert torch.isfinite(probs).all() and float(probs.sum()) == pytest.approx(1.0)
    assert (probs[0, :4] == 0).all() and (probs[0, 4:] > 0).all()
    assert int(greedy_tokens(logits)) in range(4, 8)


def test_a_tied_head_gets_its_own_rows_and_the_embedding_keeps_its_table(kit: Any, llama_dir: Path) -> None:
    model = kit.PagedRunner(llama_dir).model
    model.output.weight = model.tok_embeddings.weight
    table = model.tok_embeddings.weight.detach().clone()
    apply_token_map(model, torch.tensor(MAPPED))
    assert isinstance(model.output, TokenMapHead) and model.output.weight.shape == (len(MAPPED), model.args.dim)
    assert torch.equal(model.tok_embeddings.weight, table)
    torch.testing.assert_close(model.output.weight, table[MAPPED])
    with pytest.raises(TokenMapError, match="plain linear layer"):
        apply_token_map(model, torch.tensor(MAPPED))  # already replaced


# through the compiled rollout: a cold compile of its own graph (~60 s here), so the slow tier
@pytest.mark.parametrize("rollout", ["off", pytest.param("on", marks=pytest.mark.slow)])
def test_a_mapped_draft_proposes_only_mapped_tokens_and_the_output_is_unchanged(
    kit: Any, llama_dir: Path, mapped_draft: Path, rollout: str
) -> None:
    """Greedy: the same tokens as without speculation, through eager draft steps and the compiled rollout; every
    draft token is in the map, and the draft (the target's weights) has every mapped continuation accepted."""
    if rollout == "on" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        pytest.skip("the compiled rollout needs a C++ compiler")
    prompts = kit.random_prompts([9, 30, 4, 17], seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * len(prompts)
    expected = kit.run_to_completion(kit.make_engine(llama_dir), prompts, params)
    engine = kit.make_engine(llama_dir, max_concurrency=1 if rollout == "on" else 32, speculative=SpeculativeConfig(
        enabled=True, method="draft", draft_model=str(mapped_draft), num_draft_tokens=4, adaptive=False,
        draft_token_map="token_map.json", draft_rollout=rollout, draft_rollout_wrapper="python"))
    proposer = engine.speculator.proposer
    assert isinstance(proposer, DraftModelProposer) and proposer.token_map_size == len(MAPPED)
    assert (proposer.rollout is not None) == (rollout == "on")
    proposed: list[int] = []
    original = proposer.propose

    def recording(*args: Any, **kwargs: Any) -> Any:
        proposals = original(*args, **kwargs)
        proposed.extend(t for drafts in proposals.tokens.values() for t in drafts)
        return proposals

    proposer.propose = recording  # type: ignore[method-assign]
    assert kit.run_to_completion(engine, prompts, params) == expected
    assert proposed and set(proposed) <= set(MAPPED)
    stats = engine.stats().spec
    assert stats.num_accepted_tokens > 0
    if rollout == "on":
        assert proposer.rollouts_total > 0


def test_sampled_requests_with_a_mapped_draft_run_and_stay_in_the_vocabulary(
    kit: Any, llama_dir: Path, mapped_draft: Path
) -> None:
    prompts = kit.random_prompts([12, 5], seed=8)
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, ignore_eos=True, seed=i) for i in range(2)]
    engine = kit.make_engine(llama_dir, speculative=SpeculativeConfig(
        enabled=True, method="draft", draft_model=str(mapped_draft), num_draft_tokens=3, adaptive=False,
        draft_token_map="token_map.json"))
    outputs = kit.run_to_completion(engine, prompts, params)
    assert [len(o) for o in outputs] == [20, 20] and all(0 <= t < 128 for o in outputs for t in o)
    assert engine.stats().spec.num_draft_tokens > 0
    assert engine.blocks.num_used == 0


def test_an_engine_whose_token_map_is_missing_fails_at_start_up_naming_it(kit: Any, llama_dir: Path) -> None:
    with pytest.raises(TokenMapError, match="absent.json does not exist"):
        kit.make_engine(llama_dir, speculative=SpeculativeConfig(
            enabled=True, method="draft", draft_model=str(llama_dir), draft_token_map="absent.json"))


def test_most_frequent_counts_every_stream_and_breaks_ties_by_id() -> None:
    streams = [torch.tensor([5, 5, 5, 2, 2, 9]), torch.tensor([[9, 9], [7, 2]])]
    assert most_frequent(streams, 3, 10) == [2, 5, 9]  # 2: 3, 5: 3, 9: 3 -> by id
    assert most_frequent(streams, 4, 10) == [2, 5, 9, 7]
    assert most_frequent(streams, 6, 10)[4:] == [0, 1]  # unseen tokens last, by id
    with pytest.raises(TokenMapError, match="larger than the vocabulary"):
        most_frequent(streams, 11, 10)


def test_the_build_command_writes_the_most_frequent_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from serving.demo import target_path

    text = tmp_path / "code.py"
    text.write_text("def f(x):\n    return x\n" * 20 + "class Unusual:\n    pass\n")
    out = tmp_path / "draft" / "token_map.json"
    assert token_map_module.main(["build", str(text), "--tokenizer", str(target_path()), "--size", "6",
                                  "--out", str(out)]) == 0
    ids = json.loads(out.read_text())
    assert len(ids) == 6 and read_token_map(out, 4096).tolist() == sorted(ids)
    from transformers import AutoTokenizer

    tokens = AutoTokenizer.from_pretrained(str(target_path()))(text.read_text(), add_special_tokens=False)
    counts = torch.bincount(torch.tensor(tokens["input_ids"]), minlength=4096)
    assert counts[ids].min() >= counts.sort(descending=True).values[5]  # the six most frequent
    assert f"{out}: 6 token ids" in capsys.readouterr().out
    assert [p.name for p in out.parent.iterdir()] == ["token_map.json"]  # no partial file left behind


@pytest.mark.parametrize("args, message", [
    (["--size", "0"], "--size must be a positive integer"),
    (["--size", "4", "MISSING"], "no such text file"),
])
def test_the_build_command_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                             message: str) -> None:
    text = tmp_path / "t.py"
    text.write_text("x = 1\n")
    files = [str(tmp_path / a) if a == "MISSING" else a for a in args]
    argv = ["build", "--tokenizer", "/nonexistent", "--out", str(tmp_path / "m.json"), *files]
    if "MISSING" not in args:
        argv.append(str(text))
    with pytest.raises(SystemExit):
        token_map_module.main(argv)
    assert message in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()


def test_write_token_map_replaces_a_map_whole_and_leaves_it_readable(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    write_token_map([3, 1], path)
    assert path.stat().st_mode & 0o777 == 0o644  # the server may run as another user than who built the map
    write_token_map([7], path)
    assert json.loads(path.read_text()) == [7]
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]
