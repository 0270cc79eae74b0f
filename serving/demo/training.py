"""Shared pieces of the demo training scripts: model shapes, data, schedule, checkpoints."""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from serving.demo import corpus

if TYPE_CHECKING:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

MODELS_DIR = Path(__file__).with_name("models")
TOKENIZER_DIR = Path(__file__).with_name("tokenizer")


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    tied: bool = True  # lm_head shares the token embedding table


TARGET_SHAPE = Shape(layers=8, hidden=256, heads=8, kv_heads=4, intermediate=704)
# Two layers, so the draft can learn copy (induction) heads; a separate lm_head costs nothing per token.
# MLP 256 keeps it >= 8x cheaper than the target per token (python -m serving.demo.draft_cost).
DRAFT_SHAPE = Shape(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, tied=False)
TINY_SHAPE = Shape(layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64)


def llama_config(shape: Shape, tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        hidden_act="silu",
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=shape.tied,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def encode_files(tokenizer: PreTrainedTokenizerBase, files: list[str], cache_dir: Path | None = None) -> torch.Tensor:
    """All files as one flat token stream, each file followed by the eos token.

    With cache_dir, the stream is kept there keyed by the tokenizer and the file list, so a
    restarted or follow-on run (distillation after training) skips re-encoding.
    """
    import hashlib

    import torch

    cache = None
    if cache_dir is not None:
        key = hashlib.sha256((tokenizer.backend_tokenizer.to_str() + "\n".join(files)).encode()).hexdigest()
        cache = cache_dir / f"tokens-{key[:16]}.pt"
        if cache.exists():
            return torch.load(cache)
    texts = list(corpus.read_texts(files))
    ids: list[int] = []
    for encoded in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]:
        ids.extend(encoded)
        ids.append(tokenizer.eos_token_id)
    stream = torch.tensor(ids, dtype=torch.long)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(stream, cache)
    return stream


def random_windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, length + 1] windows at random offsets (inputs are [:, :-1], labels [:, 1:])."""
    import torch

    starts = torch.randint(0, len(stream) - length - 1, (batch,), generator=gen)
    return torch.stack([stream[s : s + length + 1] for s in starts.tolist()])


def fixed_windows(stream: torch.Tensor, length: int, limit: int) -> torch.Tensor:
    """Non-overlapping [n, length + 1] windows from the start of the stream, for evaluation."""
    n = min(limit, (len(stream) - 1) // length)
    return stream[: n * length + 1].unfold(0, length + 1, length)[:n]


def cosine_lr(progress: float, peak: float, warmup: float = 0.02, floor: float = 0.1) -> float:
    """Linear warm-up, then cosine decay to floor × peak; progress runs from 0 to 1."""
    if progress < warmup:
        return peak * max(progress, 1e-3) / warmup
    frac = min(1.0, (progress - warmup) / (1 - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


class Clock:
    """Training progress as the larger of steps done and wall-clock budget spent."""

    def __init__(self, steps: int, max_minutes: float) -> None:
        self.steps = steps
        self.budget_s = max_minutes * 60
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def progress(self, step: int) -> float:
        return max(step / self.steps, self.elapsed() / self.budget_s)

    def done(self, step: int) -> bool:
        return self.progress(step) >= 1.0


def save_checkpoint(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, out: Path, meta: dict[str, Any]
) -> None:
    """Write model + tokenizer to a sibling temp dir, then swap it in, so a kill never leaves half."""
    import json

    from transformers import GenerationConfig

    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp), save_jinja_files=False)
    (tmp / "training.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    old = out.with_name(out.name + ".old")
    if out.exists():
        if old.exists():
            shutil.rmtree(old)
        out.rename(old)
    tmp.rename(out)
    if old.exists():
        shutil.rmtree(old)


def add_common_args(parser: Any, out: Path, steps: int, max_minutes: float) -> None:
    parser.add_argument("--out", type=Path, default=out)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--max-minutes", type=float, default=max_minutes)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--checkpoint-minutes", type=float, default=5.0)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--max-files", type=int, default=None, help="use the first N training files (tests)")
    parser.add_argument("--token-cache", type=Path, default=None, help="keep the encoded corpus here")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer x 32 model, to prove the script runs")
