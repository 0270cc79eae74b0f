"""Sharding without processes: each rank's slices, the refusals, and the shards' layers summed in lock-step
(the all-reduce done by hand) against the unsharded model — fast checks of the column/row split and GQA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from serving.config import ServerConfig
from serving.engine.batch import SequenceInput, build_forward_batch
from serving.engine.config import EngineConfig
from serving.engine.kv_cache import KVCache
from serving.engine.loader import load_model, read_model_args, read_state_dict, safetensors_files
from serving.engine.model import Transformer
from serving.engine.parallel.shard import check_shardable, read_shard, shard_args


@pytest.fixture(scope="module")
def gqa_llama(kit, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 8 query heads over 4 KV heads (GQA), biases everywhere: tp 2 and 4 both divide
    return kit.save_tiny_model(tmp_path_factory.mktemp("gqa-llama"), "llama", num_attention_heads=8,
                               num_key_value_heads=4, attention_bias=True, mlp_bias=True)


@pytest.fixture(scope="module")
def gqa_qwen2(kit, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return kit.save_tiny_model(tmp_path_factory.mktemp("gqa-qwen2"), "qwen2", num_attention_heads=8,
                               num_key_value_heads=4)


@pytest.mark.parametrize(("kv_heads", "tp", "message"), [
    (2, 4, "exceeds the model's 2 KV heads"),
    (4, 3, "do not divide by tensor_parallel_size 3"),
    (1, 2, "exceeds the model's 1 KV heads"),
])
def test_kv_heads_that_do_not_split_are_refused(llama_dir: Path, kv_heads: int, tp: int, message: str) -> None:
    args = read_model_args(llama_dir)
    args.n_heads, args.n_kv_heads = 12, kv_heads
    with pytest.raises(ValueError, match=message):
        check_shardable(args, tp)


def test_mlp_width_that_does_not_split_is_refused(llama_dir: Path) -> None:
    args = read_model_args(llama_dir)
    args.n_heads, args.n_kv_heads, args.intermediate_size = 8, 4, 98
    with pytest.raises(ValueError, match="intermediate_size 98 does not divide by tensor_parallel_size 4"):
        check_shardable(args, 4)


def test_engine_refuses_before_starting_workers(kit, llama_dir: Path) -> None:
    # the tiny llama has 2 KV heads: 4 ranks cannot each hold one
    with pytest.raises(ValueError, match="exceeds the model's 2 KV heads"):
        kit.make_engine(llama_dir, tensor_parallel_size=4)


def test_server_config_passes_tensor_parallel_size_to_the_engine() -> None:
    config = ServerConfig.model_validate({"model": {"path": "/models/x", "tensor_parallel_size": 4}})
    assert EngineConfig.from_server_config(config).tensor_parallel_size == 4


@pytest.mark.parametrize("tp", [2, 4])
def test_rank_slices_put_back_together_are_the_checkpoint(gqa_llama: Path, tp: int) -> None:
    full = read_state_dict(gqa_llama)
    args = read_model_args(gqa_llama)
    shards = [read_shard(safetensors_files(gqa_llama), args, rank, tp) for rank in range(tp)]
    for name, tensor in full.items():
        parts = [s[name] for s in shards]
        if any(k in name for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            assert all(p.shape[0] == tensor.shape[0] // tp for p in parts), name
            assert torch.equal(torch.cat(parts, 0), tensor), name  # column-parallel: output features
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, 1), tensor), name  # row-parallel: input features
        elif name.endswith(("o_proj.bias", "down_proj.bias")):
            assert torch.equal(parts[0], tensor) and all(not p.any() for p in parts[1:]), name  # added once
        else:
            assert all(torch.equal(p, tensor) for p in parts), name  # replicated


def lockstep_logits(shards: list[Transformer], prompts: list[list[int]]) -> torch.Tensor:
    """The tp forward with the all-reduce done by hand: every rank's layer half, summed, fed to all ranks."""
    a = shards[0].args
    caches = [KVCache(a.n_layers, 16, 16, s.args.n_kv_heads, a.head_dim, torch.float32, torch.device("cpu"))
              for s in shards]
    seqs, next_block = [], 0
    for p in prompts:
        blocks = -(-len(p) // 16)
        seqs.append(SequenceInput(p, 0, list(range(next_block, next_block + blocks)), list(range(len(p)))))
        next_block += blocks
    batch = build_forward_batch(seqs, 16, a.n_rep, torch.device("cpu"))
    x = shards[0].tok_embeddings(batch.input_ids)
    cos = shards[0].rope_cos[batch.positions].unsqueeze(1)
    sin = shards[0].rope_sin[batch.positions].unsqueeze(1)
    for i in range(a.n_layers):
        layers = [s.layers[i] for s in shards]
        pairs = zip(layers, caches, strict=True)
        x = x + sum(ly.attention(ly.attention_norm(x), cos, sin, batch, c, i) for ly, c in pairs)
        x = x + sum(ly.feed_forward(ly.ffn_norm(x)) for ly in layers)
    return shards[0].compute_logits(x, batch.logits_index)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("model", ["gqa_llama", "gqa_qwen2"])
@torch.inference_mode()
def test_shards_summed_in_lockstep_match_the_whole_model(kit, request: pytest.FixtureRequest, model: str,
                                                        tp: int) -> None:
    model_dir = request.getfixturevalue(model)
    prompts = kit.random_prompts([7, 20, 33])
    whole = kit.PagedRunner(model_dir)
    expected = whole.step(prompts, [(0, 0, 7), (1, 0, 20), (2, 0, 33)])
    shards = [load_model(model_dir, torch.float32, torch.device("cpu"), 512, shard=(rank, tp)) for rank in range(tp)]
    assert shards[0].args.n_heads == 8 // tp and shards[0].args.n_kv_heads == 4 // tp
    assert shards[0].args.n_rep == whole.model.args.n_rep
    assert shard_args(whole.model.args, tp).intermediate_size == 96 // tp
    got = lockstep_logits(shards, prompts)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@torch.inference_mode()
def test_int8_shards_stay_as_close_to_fp32_as_one_int8_model(kit, gqa_llama: Path) -> None:
    # each rank quantizes its own slice per output channel: not bit-equal to one int8 model, but as accurate
    prompts = kit.random_prompts([7, 20, 33])

    def load(quantization: str, rank: int = 0, tp: int = 1) -> Transformer:
        return load_model(gqa_llama, torch.float32, torch.device("cpu"), 512, quantization,  # type: ignore[arg-type]
                          shard=(rank, tp))

    reference = lockstep_logits([load("none")], prompts)
    one_error = (lockstep_logits([load("int8")], prompts) - reference).abs().max().item()
    sharded = lockstep_logits([load("int8", rank, 2) for rank in range(2)], prompts)
    sharded_error = (sharded - reference).abs().max().item()
    assert 0 < sharded_error <= 2 * one_error, (sharded_error, one_error)
