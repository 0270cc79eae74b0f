"""Train the demo target (Llama, 8 layers x 256, GQA 8/4 heads) from scratch on the stdlib corpus.

    python -m serving.demo.train_target [--out DIR] [--steps N] [--max-minutes M]

Next-token cross-entropy, AdamW, warm-up + cosine schedule over the larger of steps done and
wall-clock budget spent. Checkpoints (HF format, tokenizer included) are written every few
minutes, so a killed run still leaves usable weights.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from serving.demo import corpus
from serving.demo.training import (
    MODELS_DIR,
    TARGET_SHAPE,
    TINY_SHAPE,
    TOKENIZER_DIR,
    Clock,
    add_common_args,
    cosine_lr,
    encode_files,
    fixed_windows,
    llama_config,
    random_windows,
    save_checkpoint,
)

log = logging.getLogger(__name__)


def train_target(args: argparse.Namespace) -> Path:
    import torch
    import torch.nn.functional as F
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
    train_files, heldout_files = corpus.split()
    if args.max_files is not None:
        train_files, heldout_files = train_files[: args.max_files], heldout_files[:2]
    train = encode_files(tokenizer, train_files, args.token_cache)
    heldout = fixed_windows(encode_files(tokenizer, heldout_files), args.seq_len, limit=32)
    log.info("train tokens %d from %d files; held-out windows %d", len(train), len(train_files), len(heldout))

    if args.init_from is not None:  # continue from an earlier run's weights with a fresh schedule
        model = LlamaForCausalLM.from_pretrained(str(args.init_from), dtype=torch.float32)
    else:
        model = LlamaForCausalLM(llama_config(TINY_SHAPE if args.tiny else TARGET_SHAPE, tokenizer))
    log.info("target parameters: %d", sum(p.numel() for p in model.parameters()))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(args.seed)
    clock = Clock(args.steps, args.max_minutes)
    last_ckpt = 0.0
    step = 0
    meta: dict[str, object] = {"script": "serving.demo.train_target", "seed": args.seed}
    if args.init_from is not None:
        previous = args.init_from / "training.json"
        meta["continued_from"] = json.loads(previous.read_text()) if previous.exists() else str(args.init_from)

    def heldout_loss() -> float:
        model.eval()
        with torch.no_grad():
            losses = [F.cross_entropy(model(w[None, :-1]).logits[0], w[1:]).item() for w in heldout.unbind(0)]
        model.train()
        return sum(losses) / len(losses)

    model.train()
    while not clock.done(step):
        lr = cosine_lr(clock.progress(step), args.lr)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = random_windows(train, args.batch_size, args.seq_len, gen)
        logits = model(batch[:, :-1]).logits  # [batch, seq, vocab]
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 20 == 0 or step == 1:
            log.info("step %d  loss %.4f  lr %.2e  %.1f min", step, loss.item(), lr, clock.elapsed() / 60)
        if step % args.eval_every == 0:
            log.info("step %d  held-out loss %.4f", step, heldout_loss())
        if clock.elapsed() - last_ckpt > args.checkpoint_minutes * 60:
            last_ckpt = clock.elapsed()
            meta.update(steps=step, minutes=round(clock.elapsed() / 60, 2), train_loss=loss.item())
            save_checkpoint(model, tokenizer, args.out, meta)
            log.info("checkpoint at step %d -> %s", step, args.out)

    final = heldout_loss()
    meta.update(
        steps=step,
        minutes=round(clock.elapsed() / 60, 2),
        heldout_loss=round(final, 4),
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        peak_lr=args.lr,
        train_tokens_seen=step * args.batch_size * args.seq_len,
    )
    save_checkpoint(model, tokenizer, args.out, meta)
    log.info("done: %d steps in %.1f min, held-out loss %.4f -> %s", step, clock.elapsed() / 60, final, args.out)
    return args.out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, out=MODELS_DIR / "target", steps=20000, max_minutes=50)
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER_DIR)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--init-from", type=Path, default=None, help="start from these weights (continue training)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    train_target(args)


if __name__ == "__main__":
    main()
