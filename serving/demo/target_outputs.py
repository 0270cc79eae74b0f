"""The target's own greedy continuations of training-split prompts: distillation data for the draft.

    python -m serving.demo.target_outputs --out FILE [--windows N] [--prompt-len 129] [--new-tokens 128]
                                          [--corpus-tokens FILE] [--concurrency 32] [--max-minutes M]

A greedy verifier accepts a drafted token when it is the target's argmax *on the target's own text*. Held-out
agreement is measured on human-written code, and drafts distilled longer on that corpus agreed more there
but were accepted less on the target's continuations (docs/benchmarks/log.md). This writes what the target generates:
each row is a prompt of `--prompt-len` tokens from a seeded random offset of the training split, followed by
the target's `--new-tokens` greedy tokens (eos ignored, as `bench spec` does). `distill_draft
--target-outputs FILE` mixes these rows into its batches.

The rows come from our engine (continuous batching, the target on CPU) and are saved as an int16 tensor
[N, prompt_len + new_tokens], written to a temporary file and renamed, so a killed run leaves no half file.
Held-out files are never used: prompts come from the training split only.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from serving.demo import corpus
from serving.demo.training import MODELS_DIR, encode_files

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def generate(target: Path, stream: torch.Tensor, windows: int, prompt_len: int, new_tokens: int, concurrency: int,
             seed: int, max_minutes: float) -> torch.Tensor:
    """[n, prompt_len + new_tokens] rows (n <= windows: fewer when the time box ends first)."""
    import torch

    from serving.config import CPU_KV_CACHE_BYTES
    from serving.engine.config import EngineConfig
    from serving.engine.engine import LLMEngine
    from serving.engine.types import GenerationRequest, SamplingParams

    engine = LLMEngine.from_config(EngineConfig(
        model=str(target), device="cpu", max_concurrency=concurrency, max_batched_tokens=max(512, concurrency),
        kv_cache_bytes=CPU_KV_CACHE_BYTES, max_model_len=prompt_len + new_tokens,
    ))
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - prompt_len, (windows,), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    prompts = {f"w{i}": stream[s : s + prompt_len].tolist() for i, s in enumerate(starts)}
    outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
    pending = list(prompts)
    deadline = time.monotonic() + max_minutes * 60
    finished: list[str] = []
    in_flight = 0
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < concurrency and time.monotonic() < deadline:
            rid = pending.pop(0)
            engine.add_request(GenerationRequest(rid, prompts[rid], params))
            in_flight += 1
        if not engine.has_unfinished_requests():
            break  # the time box ended with nothing in flight
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
            if out.finished:
                in_flight -= 1
                finished.append(out.request_id)
                if len(finished) % 64 == 0:
                    log.info("%d of %d rows", len(finished), windows)
    engine.close()
    rows = [prompts[rid] + outputs[rid] for rid in finished if len(outputs[rid]) == new_tokens]
    return torch.tensor(rows, dtype=torch.int16)


def main(argv: list[str] | None = None) -> None:
    import torch
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=MODELS_DIR / "target")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--windows", type=int, default=4096, help="prompts to continue (at most)")
    parser.add_argument("--prompt-len", type=int, default=129)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-minutes", type=float, default=10.0, help="stop admitting prompts after this")
    parser.add_argument("--corpus-tokens", type=Path, default=None,
                        help="the training split as a saved token stream (distill_draft --corpus-tokens)")
    parser.add_argument("--token-cache", type=Path, default=None, help="keep the encoded corpus here")
    args = parser.parse_args(argv)
    for name in ("windows", "prompt_len", "new_tokens", "concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(str(args.target))
    if len(tokenizer) > 2**15:
        parser.error(f"the target's vocabulary ({len(tokenizer)}) does not fit the int16 rows this writes")
    if args.corpus_tokens is not None:
        from serving.demo.distill_draft import load_corpus_tokens

        stream = load_corpus_tokens(args.corpus_tokens, tokenizer)
    else:
        train_files, _ = corpus.split()
        stream = encode_files(tokenizer, train_files, args.token_cache)
    started = time.monotonic()
    rows = generate(args.target, stream, args.windows, args.prompt_len, args.new_tokens, args.concurrency,
                    args.seed, args.max_minutes)
    if len(rows) == 0:
        raise SystemExit("target_outputs: no row finished inside --max-minutes; nothing written")
    tmp = args.out.with_name(args.out.name + ".tmp")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(rows, tmp)
    os.replace(tmp, args.out)
    log.info("%d rows of %d tokens in %.1f min -> %s", len(rows), rows.shape[1], (time.monotonic() - started) / 60,
             args.out)


if __name__ == "__main__":
    main()
