"""Distil the demo draft (Llama, 2 layers x 128, untied lm_head) from the trained target.

    python -m serving.demo.distill_draft [--target DIR] [--out DIR] [--steps N] [--max-minutes M]
                                         [--layers N] [--intermediate N] [--tied/--no-tied]
    python -m serving.demo.distill_draft --init-from DIR ...   # continue a draft in its own shape
    python -m serving.demo.distill_draft --grow-from DIR ...   # carry a draft into the shape above

The draft learns the target's next-token distribution on training-split windows: forward KL
from the target's softmax, plus a weighted cross-entropy on the target's greedy token (what a
greedy verifier accepts). A fresh draft's embedding (and untied lm_head) starts from the target's
embedding, projected onto the top principal directions, which gives the tiny model a head start.

`--grow-from` starts from a trained draft of the same width instead and keeps what it learnt
(`grow_draft`): embedding, norms and every existing layer are copied (an MLP narrowed by `--intermediate`
keeps its strongest units), each added layer starts as the identity (its attention output and MLP down
projections are zero), and an untied lm_head starts as the source's head (its embedding table if tied),
so the grown draft begins computing what the source did (tested; exactly so unless the MLP narrows).
The shape is the draft shape with `--layers`/`--intermediate`/`--tied` applied, as for a fresh draft.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from serving.demo import corpus
from serving.demo.training import (
    DRAFT_SHAPE,
    MODELS_DIR,
    TINY_SHAPE,
    Clock,
    Shape,
    add_common_args,
    cosine_lr,
    encode_files,
    fixed_windows,
    llama_config,
    random_windows,
    save_checkpoint,
)

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

log = logging.getLogger(__name__)


def grow_draft(source: LlamaForCausalLM, shape: Shape, tokenizer: Any) -> LlamaForCausalLM:
    """A draft of `shape` that computes what `source` (a Llama of the same width, no deeper) computes."""
    import torch
    from transformers import LlamaForCausalLM

    src_cfg = source.config
    if (src_cfg.hidden_size, src_cfg.num_attention_heads, src_cfg.num_key_value_heads) != (
            shape.hidden, shape.heads, shape.kv_heads):
        raise ValueError(
            f"--grow-from keeps the width: the source is {src_cfg.hidden_size} wide with {src_cfg.num_attention_heads}"
            f"/{src_cfg.num_key_value_heads} heads, the new shape {shape.hidden} with {shape.heads}/{shape.kv_heads}"
        )
    if shape.layers < src_cfg.num_hidden_layers:
        raise ValueError(f"--layers {shape.layers} is fewer than the source's {src_cfg.num_hidden_layers}")
    if shape.tied and not src_cfg.tie_word_embeddings:
        raise ValueError("the source's lm_head is untied: tying it to the embedding would change what it computes")
    grown = LlamaForCausalLM(llama_config(shape, tokenizer))
    with torch.no_grad():
        grown.model.embed_tokens.weight.copy_(source.model.embed_tokens.weight)
        grown.model.norm.weight.copy_(source.model.norm.weight)
        if not shape.tied:  # the source's head: its own, or its embedding table when tied
            grown.lm_head.weight.copy_(source.lm_head.weight)
        for i, layer in enumerate(grown.model.layers):
            if i >= src_cfg.num_hidden_layers:  # a new layer: the identity on the residual stream at first
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
                continue
            old = source.model.layers[i]
            layer.self_attn.load_state_dict(old.self_attn.state_dict())
            layer.input_layernorm.load_state_dict(old.input_layernorm.state_dict())
            layer.post_attention_layernorm.load_state_dict(old.post_attention_layernorm.state_dict())
            gate, up, down = old.mlp.gate_proj.weight, old.mlp.up_proj.weight, old.mlp.down_proj.weight
            keep = min(shape.intermediate, gate.shape[0])
            # the units that move the residual most: |gate row| x |up row| x |down column|
            strength = gate.norm(dim=1) * up.norm(dim=1) * down.norm(dim=0)
            units = strength.topk(keep).indices.sort().values
            layer.mlp.down_proj.weight.zero_()  # units beyond the source's (a wider MLP) add nothing at first
            layer.mlp.gate_proj.weight[:keep] = gate[units]
            layer.mlp.up_proj.weight[:keep] = up[units]
            layer.mlp.down_proj.weight[:, :keep] = down[:, units]
    return grown


def distill_draft(args: argparse.Namespace) -> Path:
    import torch
    import torch.nn.functional as F
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 weights, tf32 products: the draft is tiny either way
    tokenizer = AutoTokenizer.from_pretrained(str(args.target))
    target = LlamaForCausalLM.from_pretrained(str(args.target), dtype=torch.float32).eval().to(device)
    target.requires_grad_(False)
    train_files, heldout_files = corpus.split()
    if args.max_files is not None:
        train_files, heldout_files = train_files[: args.max_files], heldout_files[:2]
    train = load_corpus_tokens(args.corpus_tokens, tokenizer) if args.corpus_tokens is not None \
        else encode_files(tokenizer, train_files, args.token_cache)
    heldout = fixed_windows(encode_files(tokenizer, heldout_files), args.seq_len, limit=16).to(device)
    generated = load_target_outputs(args.target_outputs, tokenizer, args.seq_len) \
        if args.target_outputs is not None else None
    n_generated = round(args.target_outputs_share * args.batch_size) if generated is not None else 0

    shape = TINY_SHAPE if args.tiny else DRAFT_SHAPE
    shape = replace(
        shape,
        layers=args.layers or shape.layers,
        intermediate=args.intermediate or shape.intermediate,
        tied=shape.tied if args.tied is None else args.tied,
    )
    if args.init_from is not None:  # continue an earlier distillation, in its shape, with a fresh schedule
        draft = LlamaForCausalLM.from_pretrained(str(args.init_from), dtype=torch.float32)
    elif args.grow_from is not None:
        source = LlamaForCausalLM.from_pretrained(str(args.grow_from), dtype=torch.float32)
        draft = grow_draft(source, shape, tokenizer)
        del source
    else:
        draft = LlamaForCausalLM(llama_config(shape, tokenizer))
        with torch.no_grad():
            # Top principal directions of the target's token embeddings, at the target's scale.
            emb = target.model.embed_tokens.weight  # [vocab, target_hidden]
            u, s, _ = torch.linalg.svd(emb - emb.mean(0), full_matrices=False)
            init = u[:, : shape.hidden] * s[: shape.hidden]  # [vocab, draft_hidden]
            draft.model.embed_tokens.weight.copy_(init * (emb.std() / init.std()))
            if not shape.tied:
                draft.lm_head.weight.copy_(draft.model.embed_tokens.weight)
    # the context it learns: speculative.draft_context auto keeps the draft's reading of a sequence within it
    draft.config.max_position_embeddings = args.seq_len
    draft.to(device)  # type: ignore[arg-type]  # transformers' typing of PreTrainedModel.to
    log.info("draft parameters: %d", sum(p.numel() for p in draft.parameters()))

    opt = torch.optim.AdamW(draft.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    clock = Clock(args.steps, args.max_minutes)
    cfg = draft.config
    meta: dict[str, object] = {
        "script": "serving.demo.distill_draft",
        "seed": args.seed,
        "shape": {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                  "intermediate": cfg.intermediate_size, "tied": bool(cfg.tie_word_embeddings)},
    }
    for key, start in (("continued_from", args.init_from), ("grown_from", args.grow_from)):
        if start is not None:
            previous = start / "training.json"
            meta[key] = json.loads(previous.read_text()) if previous.exists() else str(start)
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
        parts = [random_windows(train, args.batch_size - n_generated, args.seq_len, gen)] \
            if n_generated < args.batch_size else []
        if n_generated:
            parts.append(generated_windows(generated, n_generated, args.seq_len, gen))
        inputs = torch.cat(parts)[:, :-1].to(device)
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
        device=device.type,
    )
    if args.corpus_tokens is not None:
        meta["corpus_tokens"] = {"file": args.corpus_tokens.name, "tokens": len(train)}
    if generated is not None:
        meta["target_outputs"] = {"file": args.target_outputs.name, "rows": len(generated),
                                  "row_tokens": generated.shape[1], "per_batch": n_generated}
    save_checkpoint(draft.cpu(), tokenizer, args.out, meta)
    log.info(
        "done: %d steps in %.1f min, held-out agreement %.4f -> %s", step, clock.elapsed() / 60, agreement, args.out
    )
    return args.out


def load_corpus_tokens(path: Path, tokenizer: Any, what: str = "--corpus-tokens", dims: int = 1) -> Any:
    """A training stream saved by `encode_files` (its token cache): the corpus of this machine's stdlib, taken
    to another machine (a GPU host with another Python, whose stdlib would be another corpus and split)."""
    import pickle

    import torch

    try:
        stream = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, ValueError, pickle.UnpicklingError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SystemExit(f"distill_draft: {what} {path}: cannot read a token stream: {first}") from exc
    if not isinstance(stream, torch.Tensor) or stream.dim() != dims or stream.is_floating_point() or len(stream) < 2:
        raise SystemExit(f"distill_draft: {what} {path}: not a {dims}-D integer tensor of token ids")
    if int(stream.min()) < 0 or int(stream.max()) >= len(tokenizer):
        raise SystemExit(f"distill_draft: {what} {path}: token ids outside the target's vocabulary "
                         f"(0..{len(tokenizer) - 1}); was it encoded with this tokenizer?")
    return stream.long()


def load_target_outputs(path: Path, tokenizer: Any, seq_len: int) -> Any:
    """Rows written by `serving.demo.target_outputs` (prompt + the target's greedy continuation), checked."""
    rows = load_corpus_tokens(path, tokenizer, what="--target-outputs", dims=2)
    if rows.shape[1] < seq_len + 1:
        raise SystemExit(f"distill_draft: --target-outputs {path}: rows of {rows.shape[1]} tokens are shorter than "
                         f"--seq-len + 1 = {seq_len + 1}")
    return rows


def generated_windows(rows: Any, count: int, length: int, gen: Any) -> Any:
    """[count, length + 1] windows from random rows of the target's outputs, each at a random offset in its row."""
    import torch

    picks = torch.randint(0, len(rows), (count,), generator=gen)
    offsets = torch.randint(0, rows.shape[1] - length, (count,), generator=gen)
    return torch.stack([rows[r, o : o + length + 1] for r, o in zip(picks.tolist(), offsets.tolist(), strict=True)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, out=MODELS_DIR / "draft", steps=20000, max_minutes=15)
    parser.add_argument("--target", type=Path, default=MODELS_DIR / "target")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hard-weight", type=float, default=0.5)
    parser.add_argument("--init-from", type=Path, default=None,
                        help="continue these draft weights in their own shape")
    parser.add_argument("--grow-from", type=Path, default=None,
                        help="start from a draft of the same width, carried into the draft shape (grow_draft)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers of a new or grown draft")
    parser.add_argument("--intermediate", type=int, default=None, help="MLP width of a new or grown draft")
    parser.add_argument("--tied", action=argparse.BooleanOptionalAction, default=None,
                        help="lm_head shares the embedding table (default: the draft shape's choice)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the target and the draft both run there)")
    parser.add_argument("--corpus-tokens", type=Path, default=None,
                        help="train on this saved token stream (an --token-cache file) instead of encoding the "
                             "stdlib here: keeps the corpus and split of the machine that wrote it")
    parser.add_argument("--target-outputs", type=Path, default=None,
                        help="rows of the target's own greedy continuations (python -m serving.demo.target_outputs) "
                             "mixed into every batch")
    parser.add_argument("--target-outputs-share", type=float, default=0.5,
                        help="fraction of each batch taken from --target-outputs (default %(default)s)")
    args = parser.parse_args(argv)
    if not 0.0 <= args.target_outputs_share <= 1.0:
        parser.error("--target-outputs-share must be between 0 and 1")
    if args.init_from is not None and args.grow_from is not None:
        parser.error("--init-from and --grow-from exclude each other")
    if args.init_from is not None and (args.layers, args.intermediate, args.tied) != (None, None, None):
        parser.error("--init-from continues a draft in its own shape; --grow-from carries it into another")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    distill_draft(args)


if __name__ == "__main__":
    main()
