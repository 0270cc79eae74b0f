"""Evaluate the bundled demo pair on held-out stdlib code.

    python -m serving.demo.evaluate [--target DIR] [--draft DIR] [--max-windows N] [--json-only]

Prints a short table, then one JSON object: held-out loss and perplexity of target and draft,
teacher-forced greedy top-1 agreement between draft and target (the per-token acceptance rate a
greedy verifier would see on this text), and greedy continuations of held-out code prompts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from serving.demo import corpus, draft_path, load_prompts, target_path
from serving.demo.training import encode_files, fixed_windows

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

# Spread across the held-out files rather than the first few functions of the first file.
CONTINUATION_PROMPTS = ("code-004", "code-016", "code-030")


def dir_size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20


def score(target: PreTrainedModel, draft: PreTrainedModel, windows: torch.Tensor, batch: int = 8) -> dict[str, float]:
    """Summed losses and argmax agreement over [n, length + 1] windows, teacher-forced."""
    import torch
    import torch.nn.functional as F

    t_loss = d_loss = 0.0
    agree = total = 0
    with torch.no_grad():
        for chunk in windows.split(batch):
            inputs, labels = chunk[:, :-1], chunk[:, 1:].reshape(-1)
            t_logits = target(inputs).logits.flatten(0, 1)  # [batch * seq, vocab]
            d_logits = draft(inputs).logits.flatten(0, 1)
            t_loss += F.cross_entropy(t_logits, labels, reduction="sum").item()
            d_loss += F.cross_entropy(d_logits, labels, reduction="sum").item()
            agree += int((t_logits.argmax(-1) == d_logits.argmax(-1)).sum())
            total += labels.numel()
    return {"tokens": total, "target_loss": t_loss / total, "draft_loss": d_loss / total, "agreement": agree / total}


def continuations(model: Any, tokenizer: Any, new_tokens: int) -> list[dict[str, str]]:
    import torch

    prompts = {p.id: p for p in load_prompts("code")}
    out = []
    for pid in CONTINUATION_PROMPTS:
        if pid not in prompts:
            continue
        prompt = prompts[pid]
        ids = tokenizer(prompt.prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            generated = model.generate(
                ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        completion = tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True)
        tail = "".join(prompt.prompt.splitlines(keepends=True)[-4:])
        out.append({"id": pid, "source": prompt.source, "prompt_tail": tail, "completion": completion})
    return out


def evaluate(target_dir: Path, draft_dir: Path, seq_len: int, max_windows: int, new_tokens: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    heldout = corpus.committed_heldout()
    windows = fixed_windows(encode_files(tokenizer, heldout), seq_len, limit=max_windows)
    start = time.monotonic()
    scores = score(target, draft, windows)
    return {
        "heldout_files": len(heldout),
        "heldout_tokens_scored": scores["tokens"],
        "window": seq_len,
        "target": {
            "path": str(target_dir),
            "parameters": sum(p.numel() for p in target.parameters()),
            "safetensors_mb": round(dir_size_mb(target_dir), 2),
            "loss": round(scores["target_loss"], 4),
            "perplexity": round(math.exp(scores["target_loss"]), 2),
        },
        "draft": {
            "path": str(draft_dir),
            "parameters": sum(p.numel() for p in draft.parameters()),
            "safetensors_mb": round(dir_size_mb(draft_dir), 2),
            "loss": round(scores["draft_loss"], 4),
            "perplexity": round(math.exp(scores["draft_loss"]), 2),
        },
        "greedy_top1_agreement": round(scores["agreement"], 4),
        "scoring_seconds": round(time.monotonic() - start, 1),
        "continuations": continuations(target, tokenizer, new_tokens) if new_tokens else [],
    }


def render_table(result: dict[str, Any]) -> str:
    rows = [
        ("model", "params", "MB", "held-out loss", "perplexity"),
        *(
            (name, f"{m['parameters']:,}", f"{m['safetensors_mb']:.1f}", f"{m['loss']:.3f}", f"{m['perplexity']:.2f}")
            for name, m in (("target", result["target"]), ("draft", result["draft"]))
        ),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.append(
        f"greedy top-1 agreement draft vs target: {result['greedy_top1_agreement']:.1%} "
        f"over {result['heldout_tokens_scored']:,} held-out tokens ({result['heldout_files']} files)"
    )
    for c in result["continuations"]:
        lines += ["", f"--- {c['id']} ({c['source']}): prompt tail", c["prompt_tail"].rstrip("\n"), "--- target:"]
        lines.append(c["completion"])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    import torch
    from transformers.utils import logging as hf_logging

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=target_path())
    parser.add_argument("--draft", type=Path, default=draft_path())
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--max-windows", type=int, default=10_000, help="cap on scored windows (all by default)")
    parser.add_argument("--new-tokens", type=int, default=64, help="continuation length; 0 skips them")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json-only", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()  # keep the command's output to the table and the JSON
    result = evaluate(args.target, args.draft, args.seq_len, args.max_windows, args.new_tokens)
    if not args.json_only:
        sys.stdout.write(render_table(result) + "\n")
    sys.stdout.write(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
