"""The plan's per-GPU weights are what the engine really loads on a rank.

`infra.capacity` sizes a tensor-parallel rank as its share of the decoder layers plus whole copies of the
embedding and lm_head (the engine replicates them). This loads rank 0 of tiny checkpoints through the
engine's own loader, sharded and quantized as a server would, and compares the bytes it holds with the
plan's figure for the same config.json. The only allowed gap is what the plan leaves out on purpose: the
RMSNorm weights, which every rank holds whole, and the per-channel scales of quantized weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infra.capacity import model_dims
from infra.config import ModelSpec
from serving.engine.loader import load_model

HIDDEN, LAYERS, VOCAB = 64, 2, 256


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tied" if request.param else "untied")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=request.param,
    )).save_pretrained(path)
    return path


def loaded_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(weight bytes, scale bytes) of every distinct tensor the model holds."""
    seen: set[int] = set()
    weights = scales = 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        size = tensor.numel() * tensor.element_size()
        if name.endswith("scales"):
            scales += size
        else:
            weights += size
    return weights, scales


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("tp", [1, 2])
def test_planned_weights_per_rank_equal_what_rank_0_loads(checkpoint: Path, quantization: str, tp: int) -> None:
    spec = ModelSpec(name="tiny", source=checkpoint.as_uri(), dtype="bf16", quantization=quantization)
    dims = model_dims(spec, "model")
    assert dims.source == "config.json" and dims.vocab_size == VOCAB
    planned = dims.weight_bytes_per_rank(tp)

    model = load_model(checkpoint, torch.bfloat16, torch.device("cpu"), 128, quantization, shard=(0, tp))
    weights, scales = loaded_bytes(model)
    # RMSNorm weights: whole on every rank and never quantized (bf16); the plan counts them with the layers,
    # split tp ways at the matmul weights' bytes
    norm_params = (2 * LAYERS + 1) * HIDDEN
    gap = norm_params * 2 - norm_params * (1 if quantization == "int8" else 2) / tp
    assert weights - planned == pytest.approx(gap), (weights, planned)
    assert scales < 0.05 * weights  # ~4 bytes per 64-wide row here; ~1/hidden of a real model's weights
