"""`speculative.draft_context`: the draft model reads at most that many tokens of a sequence, restarting on the
latest half of it, and the target's output does not change."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from serving.config import MIN_DRAFT_CONTEXT, SpeculativeSection
from serving.engine.config import SpeculativeConfig
from serving.engine.engine import LLMEngine
from serving.engine.loader import read_model_args
from serving.engine.spec.draft import DraftModelProposer, resolve_context
from serving.engine.types import GenerationRequest, SamplingParams


def _draft_dir(tmp_path: Path, llama_dir: Path, trained: int) -> Path:
    """The tiny model as a draft whose config says it was trained on `trained` positions."""
    draft = tmp_path / f"draft-{trained}"
    shutil.copytree(llama_dir, draft)
    config = json.loads((draft / "config.json").read_text())
    config["max_position_embeddings"] = trained
    (draft / "config.json").write_text(json.dumps(config))
    return draft


# ---- the setting and its resolution ---------------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("none", None), (None, None), (128, 128)])
def test_the_setting_takes_auto_none_or_a_length(value: object, expected: object) -> None:
    assert SpeculativeSection(draft_context=value).draft_context == expected
    assert SpeculativeSection().draft_context == "auto"


def test_a_context_too_short_to_restart_on_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=f"speculative.draft_context 32 is too short.*{MIN_DRAFT_CONTEXT}"):
        SpeculativeSection(draft_context=32)


@pytest.mark.parametrize("trained, setting, max_model_len, expected, reason", [
    (256, "auto", 2048, 256, "auto: the draft's max_position_embeddings, under the context (2048); past it the "
                             "draft reads the latest 128 tokens anew"),
    (2048, "auto", 2048, None, "covers the context (2048)"),
    (32, "auto", 2048, None, "too short to restart on half of it"),
    (256, None, 2048, None, "speculative.draft_context is none"),
    (4096, 300, 2048, 300, "speculative.draft_context names it"),  # explicit wins over the draft's config
    (256, 4096, 2048, None, "speculative.draft_context 4096 covers the context (2048 tokens)"),
])
def test_the_decision_and_its_reason(llama_dir: Path, trained: int, setting: int | str | None, max_model_len: int,
                                     expected: int | None, reason: str) -> None:
    args = read_model_args(llama_dir)
    args.max_position_embeddings = trained
    context, why = resolve_context(setting, args, max_model_len)
    assert context == expected and reason in why


# ---- in the engine ------------------------------------------------------------------------------------------


def _engine(kit: Any, target: Path, draft: Path, context: int | str | None) -> LLMEngine:
    spec = SpeculativeConfig(enabled=True, method="draft", draft_model=str(draft), num_draft_tokens=4,
                             adaptive=False, draft_context=context)
    return kit.make_engine(target, speculative=spec)


def _proposer(engine: LLMEngine) -> DraftModelProposer:
    assert engine.speculator is not None and isinstance(engine.speculator.proposer, DraftModelProposer)
    return engine.speculator.proposer


def _positions_read(proposer: DraftModelProposer) -> list[int]:
    """Records the highest position of every draft forward's batch (wrapping the proposer's batch builder)."""
    seen: list[int] = []
    build = proposer.builder.build

    def recording(seqs: Any) -> Any:
        seen.append(max(s.start_pos + len(s.token_ids) for s in seqs))
        return build(seqs)

    proposer.builder.build = recording  # type: ignore[method-assign]
    return seen


def test_the_draft_never_reads_past_its_context_and_the_output_is_unchanged(kit: Any, llama_dir: Path,
                                                                            tmp_path: Path) -> None:
    """Prompts of 30 and 70 tokens, 60 tokens out each, a draft that says it was trained on 64 positions: the
    longer prompt starts past the context (the draft reads its last 32), the shorter one passes it while
    decoding. Every draft forward stays under 64 positions; with the setting none the same run reads past it.
    The target's greedy output is spec-off's either way."""
    prompts = kit.random_prompts([30, 70], seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)] * 2
    expected = kit.run_to_completion(kit.make_engine(llama_dir), prompts, params)
    draft = _draft_dir(tmp_path, llama_dir, 64)

    windowed = _engine(kit, llama_dir, draft, "auto")
    proposer = _proposer(windowed)
    assert proposer.context == 64
    positions = _positions_read(proposer)
    assert kit.run_to_completion(windowed, prompts, params) == expected
    assert positions and max(positions) <= 64
    assert proposer.context_restarts_total >= 1  # the 30-token prompt's view moved on while it decoded
    assert windowed.stats().spec.num_accepted_tokens > 0  # the draft (the target itself) still proposes well
    assert not proposer.computed and not proposer.offset and proposer.blocks.num_used == 0  # all released

    whole = _engine(kit, llama_dir, draft, None)
    positions = _positions_read(_proposer(whole))
    assert kit.run_to_completion(whole, prompts, params) == expected
    assert max(positions) > 64 and _proposer(whole).context_restarts_total == 0


def test_a_restarted_view_drafts_what_the_draft_drafts_from_those_tokens_alone(kit: Any, llama_dir: Path,
                                                                             tmp_path: Path) -> None:
    """The first proposal for a 100-token prompt under a 64-token context: after the prefill the sequence has 101
    tokens, the view is its last 32, at positions counted from 0, and the draft (the tiny target itself) proposes
    its greedy continuation of those 32 tokens alone."""
    prompt = kit.random_prompts([100], seed=9)[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = kit.run_to_completion(kit.make_engine(llama_dir), [prompt], [params])[0][0]
    view = (prompt + [first])[-32:]
    alone = kit.run_to_completion(kit.make_engine(llama_dir), [view],
                                  [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)])[0]

    engine = _engine(kit, llama_dir, _draft_dir(tmp_path, llama_dir, 64), "auto")
    seen: list[list[int]] = []
    accept = engine.speculator._accept_proposals  # type: ignore[union-attr]

    def recording(proposed: Any, by_id: Any) -> None:
        seen.extend(list(t) for t in proposed.tokens.values())
        accept(proposed, by_id)

    engine.speculator._accept_proposals = recording  # type: ignore[union-attr, method-assign]
    kit.run_to_completion(engine, [prompt], [params])
    assert seen[0] == alone


def test_the_decision_is_on_the_start_up_line(kit: Any, llama_dir: Path, tmp_path: Path) -> None:
    engine = _engine(kit, llama_dir, _draft_dir(tmp_path, llama_dir, 128), "auto")
    rows = {setting: (chosen, why) for setting, chosen, why in _proposer(engine).decisions()}
    assert rows["speculative.draft_context"][0] == "128"
    assert "auto: the draft's max_position_embeddings" in rows["speculative.draft_context"][1]
    engine = _engine(kit, llama_dir, llama_dir, "auto")  # trained on the target's whole context: no window
    assert _proposer(engine).decisions()[1][1] == "whole sequence"


@pytest.mark.slow  # compiles the rollout: ~75 s here
def test_the_compiled_rollout_drafts_from_the_view_too(kit: Any, llama_dir: Path, tmp_path: Path) -> None:
    """One request alone, so the draft's compiled rollout (Python wrapper) drafts: its view restarts on the way,
    the draft cache never holds more than the context, and the output is spec-off's."""
    prompt = kit.random_prompts([50], seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True)
    expected = kit.run_to_completion(kit.make_engine(llama_dir), [prompt], [params])
    spec = SpeculativeConfig(enabled=True, method="draft", draft_model=str(_draft_dir(tmp_path, llama_dir, 64)),
                             num_draft_tokens=4, adaptive=False, draft_rollout="on")
    engine = kit.make_engine(llama_dir, speculative=spec)
    proposer = _proposer(engine)
    assert proposer.rollout is not None and proposer.context == 64
    engine.add_request(GenerationRequest("r", prompt, params))
    got: list[int] = []
    held: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            got += out.new_token_ids
        held += list(proposer.computed.values())
    assert got == expected[0]
    assert proposer.rollouts_total > 0 and proposer.context_restarts_total >= 1
    assert held and max(held) <= 64
