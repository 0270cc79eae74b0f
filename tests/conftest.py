"""Fixtures shared across test folders."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from serving.net import free_port

DEMO_TOKENIZER = Path(__file__).resolve().parents[1] / "serving" / "demo" / "tokenizer"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama checkpoint in Hugging Face layout with the demo tokenizer and a chat
    template: real weights file, real tokenizer, milliseconds per step. Written with safetensors
    directly (no transformers import). For server and deployment tests, not for output quality."""
    import torch
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("tiny-chat-model")
    vocab, dim, hidden, layers, heads, kv_heads = 4096, 64, 128, 2, 4, 2
    head_dim = dim // heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": vocab, "hidden_size": dim, "intermediate_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
        "tie_word_embeddings": False, "torch_dtype": "float32",
    }
    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    tensors = {"model.embed_tokens.weight": w(vocab, dim), "model.norm.weight": torch.ones(dim),
               "lm_head.weight": w(vocab, dim)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(heads * head_dim, dim),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, dim),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, dim),
            p + "self_attn.o_proj.weight": w(dim, heads * head_dim),
            p + "mlp.gate_proj.weight": w(hidden, dim),
            p + "mlp.up_proj.weight": w(hidden, dim),
            p + "mlp.down_proj.weight": w(dim, hidden),
            p + "input_layernorm.weight": torch.ones(dim),
            p + "post_attention_layernorm.weight": torch.ones(dim),
        }
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_TOKENIZER / name, path / name)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A loopback moto_server for the session (S3 and the other AWS APIs the tests use); reset it with
    POST /moto-api/reset."""
    port = free_port()
    binary = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen(
        [str(binary), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)
