"""Which slice of each checkpoint tensor a tensor-parallel rank holds (Megatron-style sharding).

Attention: q/k/v are column-parallel by head (rank r holds query heads [r*Hq/tp, (r+1)*Hq/tp) and the KV
heads they read, [r*Hkv/tp, (r+1)*Hkv/tp): with Hkv % tp == 0 a query head's KV head is always local);
the output projection is row-parallel (the columns of the rank's heads). MLP: gate/up column-parallel,
down row-parallel. A row-parallel layer's partial outputs are summed by one all-reduce; its bias is added
once (rank 0 keeps it, the others hold zeros). Embedding, norms and lm_head are replicated.

Slices are read straight from the safetensors files (`safe_open(...).get_slice`), so a rank reads its
share of each sharded tensor, not the whole checkpoint.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors import safe_open

from serving.engine.model import ModelArgs

# HF parameter suffix -> (dimension split, which head count or size sets the split)
_COLUMN = {"self_attn.q_proj": "q", "self_attn.k_proj": "kv", "self_attn.v_proj": "kv",
           "mlp.gate_proj": "mlp", "mlp.up_proj": "mlp"}
_ROW = {"self_attn.o_proj": "q", "mlp.down_proj": "mlp"}


def check_shardable(args: ModelArgs, tp: int) -> None:
    """Refuse a model whose heads or MLP width do not split evenly over tp ranks."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if args.n_kv_heads < tp:
        raise ValueError(f"tensor_parallel_size {tp} exceeds the model's {args.n_kv_heads} KV heads: each rank "
                         "needs at least one KV head (use a tensor_parallel_size that divides the KV heads)")
    if args.n_kv_heads % tp:
        raise ValueError(f"the model's {args.n_kv_heads} KV heads do not divide by tensor_parallel_size {tp}: "
                         "KV heads are sharded evenly across ranks")
    if args.intermediate_size % tp:
        raise ValueError(f"the model's intermediate_size {args.intermediate_size} does not divide by "
                         f"tensor_parallel_size {tp}")


def shard_args(args: ModelArgs, tp: int) -> ModelArgs:
    """One rank's model: 1/tp of the heads, KV heads and MLP width; dim, vocab and head_dim unchanged."""
    if tp == 1:
        return args
    check_shardable(args, tp)
    return dataclasses.replace(args, n_heads=args.n_heads // tp, n_kv_heads=args.n_kv_heads // tp,
                               intermediate_size=args.intermediate_size // tp)


def _split(name: str) -> tuple[str, str] | None:
    """(kind, size key) for a sharded parameter: kind "column" / "row" / "row_bias"; None if replicated."""
    module, _, param = name.rpartition(".")
    for suffix, size in _COLUMN.items():
        if module.endswith(suffix):
            return "column", size
    for suffix, size in _ROW.items():
        if module.endswith(suffix):
            return ("row" if param == "weight" else "row_bias"), size
    return None


def read_shard(files: list[Path], args: ModelArgs, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slices of the HF checkpoint's tensors (args: the full model's)."""
    per_rank = {"q": args.n_heads // tp * args.head_dim, "kv": args.n_kv_heads // tp * args.head_dim,
                "mlp": args.intermediate_size // tp}
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                split = _split(name) if tp > 1 else None
                if split is None:
                    tensors[name] = f.get_tensor(name)
                    continue
                kind, size = split
                lo, hi = rank * per_rank[size], (rank + 1) * per_rank[size]
                if kind == "column":  # output features [lo, hi): weight rows, bias entries
                    tensors[name] = f.get_slice(name)[lo:hi]
                elif kind == "row":  # input features [lo, hi): weight columns
                    tensors[name] = f.get_slice(name)[:, lo:hi]
                else:  # the all-reduce sums every rank's output: add the bias on one rank only
                    bias = f.get_tensor(name)
                    tensors[name] = bias if rank == 0 else torch.zeros_like(bias)
    return tensors
