"""The bundled prompt set loads, covers every category, and code prompts come from held-out files."""

from __future__ import annotations

import pytest

from serving.demo import CATEGORIES, corpus, load_prompts


@pytest.mark.parametrize("category", CATEGORIES)
def test_each_category_has_prompts(category):
    prompts = load_prompts(category)
    assert len(prompts) >= 5
    assert all(p.category == category and p.prompt and p.max_tokens > 0 for p in prompts)


def test_ids_are_unique():
    ids = [p.id for p in load_prompts()]
    assert len(ids) == len(set(ids))


def test_code_prompts_are_cut_from_heldout_files():
    heldout = set(corpus.committed_heldout())
    code = load_prompts("code")
    assert code and all(p.source in heldout for p in code)
    # each ends at a def line, or one docstring line after it
    assert all("def " in "".join(p.prompt.splitlines()[-2:]) for p in code)


def test_non_code_prompts_carry_chat_messages():
    for p in load_prompts():
        if p.category != "code":
            assert p.messages == [{"role": "user", "content": p.prompt}]


def test_unknown_category_is_refused():
    with pytest.raises(ValueError, match="code"):
        load_prompts("poetry")
