"""The demo tokenizer round-trips code and arbitrary unicode and renders a ChatML template."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from serving.demo import corpus, tokenizer_path


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(tokenizer_path()))


def test_vocab_size(tokenizer):
    assert len(tokenizer) == 4096


def test_round_trips_heldout_python_source(tokenizer):
    source = (corpus.stdlib_root() / corpus.committed_heldout()[0]).read_text(encoding="utf-8")
    ids = tokenizer(source, add_special_tokens=False, verbose=False)["input_ids"]
    assert tokenizer.decode(ids) == source
    assert len(ids) < len(source) / 2.5  # BPE merges actually compress code


@pytest.mark.parametrize("text", ["héllo wörld ✓", "emoji 😀🚀 and 中文 and עברית", "\ttabs\r\nand   spaces\x00nul"])
def test_round_trips_unicode(tokenizer, text):
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_special_tokens_are_single_ids(tokenizer):
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.pad_token_id == tokenizer.eos_token_id


def test_chat_template_renders_chatml(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
