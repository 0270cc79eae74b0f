"""Growing a draft into a deeper, wider, narrower or untied shape, and the pair's per-token cost on paper."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from transformers import LlamaForCausalLM

from serving.demo import draft_path, target_path
from serving.demo.distill_draft import grow_draft
from serving.demo.draft_cost import macs_per_token
from serving.demo.training import TINY_SHAPE, Shape, llama_config


class _Vocab:
    """Just what llama_config reads from a tokenizer."""

    bos_token_id = eos_token_id = pad_token_id = 0

    def __len__(self) -> int:
        return 64


def tiny_draft(shape: Shape) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(shape, _Vocab())).eval()


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))


def logits(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids).logits


@pytest.mark.parametrize(
    ("source", "grown"),
    [
        (replace(TINY_SHAPE, layers=1), replace(TINY_SHAPE, layers=3)),  # added layers start as the identity
        (replace(TINY_SHAPE, layers=1), replace(TINY_SHAPE, layers=2, tied=False)),  # + an untied head
        (TINY_SHAPE, replace(TINY_SHAPE, intermediate=96)),  # a wider MLP: the new units add nothing yet
        (replace(TINY_SHAPE, tied=False), replace(TINY_SHAPE, layers=3, tied=False)),  # an untied head is kept
    ],
)
def test_a_grown_draft_starts_computing_what_its_source_did(ids, source, grown):
    old = tiny_draft(source)
    if not source.tied:  # give the source a head of its own, so copying the embedding instead would show
        with torch.no_grad():
            old.lm_head.weight.normal_()
    new = grow_draft(old, grown, _Vocab())
    assert new.config.num_hidden_layers == grown.layers and new.config.tie_word_embeddings == grown.tied
    torch.testing.assert_close(logits(new, ids), logits(old, ids))
    if not grown.tied:
        assert new.lm_head.weight.data_ptr() != new.model.embed_tokens.weight.data_ptr()


def test_a_narrower_mlp_keeps_the_largest_channels(ids):
    old = tiny_draft(TINY_SHAPE)
    new = grow_draft(old, replace(TINY_SHAPE, intermediate=TINY_SHAPE.intermediate // 2), _Vocab())
    old_mlp, new_mlp = old.model.layers[0].mlp, new.model.layers[0].mlp
    size = (old_mlp.gate_proj.weight.norm(dim=1) * old_mlp.up_proj.weight.norm(dim=1)
            * old_mlp.down_proj.weight.norm(dim=0))
    kept = size.topk(new_mlp.gate_proj.weight.shape[0]).indices.sort().values
    torch.testing.assert_close(new_mlp.down_proj.weight, old_mlp.down_proj.weight[:, kept])
    torch.testing.assert_close(new.model.layers[1].self_attn.q_proj.weight, old.model.layers[1].self_attn.q_proj.weight)
    assert not torch.allclose(logits(new, ids), logits(old, ids))  # close to the source, not equal


@pytest.mark.parametrize(
    ("grown", "match"),
    [
        (replace(TINY_SHAPE, hidden=64), "keeps the width"),
        (replace(TINY_SHAPE, kv_heads=4), "keeps the width"),
        (replace(TINY_SHAPE, layers=1), "fewer than the source"),
    ],
)
def test_grow_refuses_what_it_cannot_carry_over(grown, match):
    with pytest.raises(ValueError, match=match):
        grow_draft(tiny_draft(TINY_SHAPE), grown, _Vocab())


def test_an_untied_head_is_not_tied_back():
    with pytest.raises(ValueError, match="untied"):
        grow_draft(tiny_draft(replace(TINY_SHAPE, tied=False)), TINY_SHAPE, _Vocab())


@pytest.mark.parametrize("context", [1, 128, 2048])
def test_bundled_draft_is_at_least_8x_cheaper_per_token_on_paper(context):
    target = json.loads((target_path() / "config.json").read_text())
    draft = json.loads((draft_path() / "config.json").read_text())
    assert macs_per_token(target, context) >= 8 * macs_per_token(draft, context)
