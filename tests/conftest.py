"""Fixtures shared across test folders."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

DEMO_TOKENIZER = Path(__file__).resolve().parents[1] / "serving" / "demo" / "tokenizer"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama with the demo tokenizer and a chat template: real weights, real
    tokenizer, milliseconds per step. For server and deployment tests, not for output quality."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-chat-model")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False,
                         initializer_range=0.1)
    LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_TOKENIZER / name, path / name)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path
