"""Distil the demo draft (Llama, 1 layer x 128) from the trained target.

    python -m serving.demo.distill_draft [--target DIR] [--out DIR] [--steps N] [--max-minutes M]

The draft learns the target's next-token distribution on training-split windows: forward KL
from the target's softmax, plus a weighted cross-entropy on the target's greedy token (what a
greedy verifier accepts). Its embedding starts from the target's, projected onto the top
principal directions, which gives the tiny model a head start.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from serving.demo import corpus
from serving.demo.training import (
    DRAFT_SHAPE,
    MODELS_DIR,
    TINY_SHAPE,
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


def distill_draft(args: argparse.Namespace) -> Path:
    import torch
    import torch.nn.functional as F
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(args.target))
    target = LlamaForCausalLM.from_pretrained(str(args.target), dtype=torch.float32).eval()
    target.requires_grad_(False)
    train_files, heldout_files = corpus.split()
    if args.max_files is not None:
        train_files, heldout_files = train_files[: args.max_files], heldout_files[:2]
    train = encode_files(tokenizer, train_files, args.token_cache)
    heldout = fixed_windows(encode_files(tokenizer, heldout_files), args.seq_len, limit=16)

    shape = TINY_SHAPE if args.tiny else DRAFT_SHAPE
    if args.init_from is not None:  # continue an earlier distillation with a fresh schedule
        draft = LlamaForCausalLM.from_pretrained(str(args.init_from), dtype=torch.float32)
    else:
        draft = LlamaForCausalLM(llama_config(shape, tokenizer))
        with torch.no_grad():
            # Top principal directions of the target's token embeddings, at the target's scale.
            emb = target.model.embed_tokens.weight  # [vocab, target_hidden]
            u, s, _ = torch.linalg.svd(emb - emb.mean(0), full_matrices=False)
            init = u[:, : shape.hidden] * s[: shape.hidden]  # [vocab, draft_hidden]
            draft.model.embed_tokens.weight.copy_(init * (emb.std() / init.std()))
    log.info("draft parameters: %d", sum(p.numel() for p in draft.parameters()))

    opt = torch.optim.AdamW(draft.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    clock = Clock(args.steps, args.max_minutes)
    meta: dict[str, object] = {"script": "serving.demo.distill_draft", "seed": args.seed}
    if args.init_from is not None:
        previous = args.init_from / "training.json"
        meta["continued_from"] = json.loads(previous.read_text()) if previous.exists() else str(args.init_from)
    last_ckpt = 0.0
    step = 0

    def heldout_agreement() -> float:
        draft.eval()
        hits = total = 0
        with torch.no_grad():
            for w in heldout.unbind(0):
                t = target(w[None, :-1]).logits.argmax(-1)
                d = draft(w[None, :-1]).logits.argmax(-1)
                hits += int((t == d).sum())
                total += t.numel()
        draft.train()
        return hits / max(total, 1)

    draft.train()
    while not clock.done(step):
        lr = cosine_lr(clock.progress(step), args.lr)
        for group in opt.param_groups:
            group["lr"] = lr
        inputs = random_windows(train, args.batch_size, args.seq_len, gen)[:, :-1]
        with torch.no_grad():
            t_logits = target(inputs).logits.reshape(-1, len(tokenizer))  # [batch * seq, vocab]
        d_logits = draft(inputs).logits.reshape(-1, len(tokenizer))
        d_logp = F.log_softmax(d_logits, -1)
        kl = F.kl_div(d_logp, F.log_softmax(t_logits, -1), log_target=True, reduction="batchmean")
        hard = F.nll_loss(d_logp, t_logits.argmax(-1))
        loss = kl + args.hard_weight * hard
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 20 == 0 or step == 1:
            log.info(
                "step %d  kl %.4f  hard %.4f  lr %.2e  %.1f min", step, kl.item(), hard.item(), lr, clock.elapsed() / 60
            )
        if step % args.eval_every == 0:
            log.info("step %d  held-out greedy agreement %.4f", step, heldout_agreement())
        if clock.elapsed() - last_ckpt > args.checkpoint_minutes * 60:
            last_ckpt = clock.elapsed()
            meta.update(steps=step, minutes=round(clock.elapsed() / 60, 2), kl=kl.item())
            save_checkpoint(draft, tokenizer, args.out, meta)

    agreement = heldout_agreement()
    meta.update(
        steps=step,
        minutes=round(clock.elapsed() / 60, 2),
        heldout_agreement=round(agreement, 4),
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        peak_lr=args.lr,
        hard_weight=args.hard_weight,
    )
    save_checkpoint(draft, tokenizer, args.out, meta)
    log.info(
        "done: %d steps in %.1f min, held-out agreement %.4f -> %s", step, clock.elapsed() / 60, agreement, args.out
    )
    return args.out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, out=MODELS_DIR / "draft", steps=20000, max_minutes=15)
    parser.add_argument("--target", type=Path, default=MODELS_DIR / "target")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hard-weight", type=float, default=0.5)
    parser.add_argument("--init-from", type=Path, default=None, help="start from these draft weights")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    distill_draft(args)


if __name__ == "__main__":
    main()
