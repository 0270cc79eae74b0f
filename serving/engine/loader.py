"""Load a Hugging Face Llama-family checkpoint (config.json + safetensors, single or sharded) into `Transformer`."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from serving.engine.model import ModelArgs, Transformer
from serving.engine.parallel.shard import read_shard, shard_args
from serving.engine.quant import Quantization, check_supported, quantize_state_dict, replace_modules

log = logging.getLogger(__name__)

_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


def read_model_args(model_dir: str | Path) -> ModelArgs:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a model directory needs config.json")
    args = ModelArgs.from_hf_config(json.loads(path.read_text()))
    generation = Path(model_dir) / "generation_config.json"
    if generation.is_file():  # chat models often list extra end tokens (e.g. end-of-turn) only here
        eos = json.loads(generation.read_text()).get("eos_token_id")
        for token in [eos] if isinstance(eos, int) else list(eos or []):
            if token not in args.eos_token_ids:
                args.eos_token_ids.append(int(token))
    return args


def resolve_dtype(name: str, args: ModelArgs, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return _DTYPES.get(str(args.torch_dtype), torch.bfloat16)
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use one of auto, fp32, bf16, fp16")
    return _DTYPES[name]


def dtype_reason(name: str, args: ModelArgs, device: torch.device) -> str:
    """Why resolve_dtype chose what it did (the start-up decisions' log line)."""
    if name != "auto":
        return f"model.dtype is {name}"
    if device.type == "cpu":
        return "auto: fp32 on CPU (the decode-attention kernel is fp32-only; verify and decode rows round alike)"
    if str(args.torch_dtype) in _DTYPES:
        return f"auto: the checkpoint's torch_dtype {args.torch_dtype} on {device.type}"
    return f"auto: bf16 on {device.type} (the checkpoint names no torch_dtype)"


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return found


def read_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors[name] = f.get_tensor(name)
    return tensors


def read_rank_state_dict(model_dir: Path, args: ModelArgs, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """The whole checkpoint (tp 1) or one tensor-parallel rank's slices of it (args: the full model's)."""
    if tp == 1:
        return read_state_dict(model_dir)
    return read_shard(safetensors_files(model_dir), args, rank, tp)


def convert_hf_state_dict(hf: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Rename HF parameters to ours, fusing q/k/v and gate/up into one matmul each."""
    prefix = "model." if "model.embed_tokens.weight" in hf else ""
    out = {
        "tok_embeddings.weight": hf[f"{prefix}embed_tokens.weight"],
        "norm.weight": hf[f"{prefix}norm.weight"],
    }
    if not args.tie_word_embeddings:
        out["output.weight"] = hf.get("lm_head.weight", hf[f"{prefix}embed_tokens.weight"])
    for i in range(args.n_layers):
        src, dst = f"{prefix}layers.{i}.", f"layers.{i}."
        attn, mlp = src + "self_attn.", src + "mlp."
        out[dst + "attention.wqkv.weight"] = torch.cat(
            [hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"]]
        )
        if args.qkv_bias:
            out[dst + "attention.wqkv.bias"] = torch.cat(
                [hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"]]
            )
        out[dst + "attention.wo.weight"] = hf[attn + "o_proj.weight"]
        if args.o_bias:
            out[dst + "attention.wo.bias"] = hf[attn + "o_proj.bias"]
        out[dst + "feed_forward.w13.weight"] = torch.cat([hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]])
        out[dst + "feed_forward.w2.weight"] = hf[mlp + "down_proj.weight"]
        if args.mlp_bias:
            out[dst + "feed_forward.w13.bias"] = torch.cat([hf[mlp + "gate_proj.bias"], hf[mlp + "up_proj.bias"]])
            out[dst + "feed_forward.w2.bias"] = hf[mlp + "down_proj.bias"]
        out[dst + "attention_norm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "ffn_norm.weight"] = hf[src + "post_attention_layernorm.weight"]
    return out


def load_model(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device, max_model_len: int,
    quantization: Quantization = "none",
    shard: tuple[int, int] = (0, 1),
) -> Transformer:
    """Build the model on `device`; with `quantization` int8/fp8 its matmul weights are quantized while loading.

    shard: (rank, tensor_parallel_size): the rank's slice of the heads and MLP (serving.engine.parallel.shard);
    its all-reduces are attached by the caller (serving.engine.parallel)."""
    model_dir = Path(model_dir)
    full_args = read_model_args(model_dir)
    rank, tp = shard
    args = shard_args(full_args, tp)
    check_supported(quantization, device)
    with torch.device("meta"):
        model = Transformer(args, max_model_len)
    quantized = replace_modules(model, quantization, dtype)
    model.quantization = quantization
    state = convert_hf_state_dict(read_rank_state_dict(model_dir, full_args, rank, tp), args)
    shares_table = args.tie_word_embeddings and quantization in ("none", "int8")
    if args.tie_word_embeddings and not shares_table:  # fp8 lm_head needs its own copy of the float table
        state["output.weight"] = state["tok_embeddings.weight"]
    state = quantize_state_dict(state, quantized, quantization, dtype, device)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (shares_table and m.startswith("output."))]
    if missing or unexpected:
        raise ValueError(f"checkpoint in {model_dir} does not match: missing {missing}, unexpected {unexpected}")
    if shares_table and quantization == "none":
        model.output.weight = model.tok_embeddings.weight
    elif shares_table:  # one int8 table: embedding rows and lm_head output channels share scales
        model.output.qweight = model.tok_embeddings.qweight
        model.output.scales = model.tok_embeddings.scales
    model.build_rope(device)  # the rope tables were built on meta; build them for real
    model.eval().requires_grad_(False)
    log.info("loaded %s (%s, %d layers, dim %d) in %s on %s, quantization %s%s", model_dir, args.model_type,
             args.n_layers, args.dim, dtype, device, quantization,
             f", tensor-parallel rank {rank} of {tp}" if tp > 1 else "")
    return model
