"""How much cheaper than the target a draft is per token, in our engine and on paper.

    python -m serving.demo.draft_cost [--target DIR] [--draft DIR ...] [--rounds N] [--context 128]

Measured cost: one decode step at batch 1 (a single-token forward after `context` cached tokens, batch
metadata, lm_head and argmax included) through the engine's `Transformer`, which is what the draft
proposer pays per drafted token and what spec-off pays per generated token. Target and drafts are timed
in interleaved rounds (the median of 20 steps each per round, then the median over rounds), so a busy
moment on a shared machine weighs on all of them alike. On paper: parameters and multiply-accumulates
per token (every matmul including the lm_head, plus attention over `context` cached tokens; the
embedding lookup is free).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from serving.demo import draft_path, target_path


def macs_per_token(config: dict[str, Any], context: int) -> int:
    """Multiply-accumulates of one decode token: projections, MLP, attention scores/values and the lm_head."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    projections = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o and k, v
    mlp = 3 * hidden * config["intermediate_size"]  # gate, up, down
    attention = 2 * heads * head_dim * context  # q·k over the context, then the weighted sum of v
    return layers * (projections + mlp + attention) + hidden * config["vocab_size"]


def measure(target: Path, drafts: list[Path], rounds: int, context: int, threads: int) -> dict[str, Any]:
    import torch

    from serving.engine.loader import load_model
    from serving.engine.timing import forward_seconds

    torch.set_num_threads(threads)
    paths = [target, *drafts]
    models = [load_model(p, torch.float32, torch.device("cpu"), 2048) for p in paths]
    for model in models:  # warm-up
        forward_seconds(model, context, 1, repeats=5)
    times: list[list[float]] = [[] for _ in paths]
    for _ in range(rounds):
        for i, model in enumerate(models):
            times[i].append(forward_seconds(model, context, 1))
    step = [statistics.median(t) for t in times]
    configs = [json.loads((p / "config.json").read_text()) for p in paths]
    macs = [macs_per_token(c, context) for c in configs]
    params = [sum(t.numel() for t in m.parameters()) for m in models]  # a tied table counts once
    out: dict[str, Any] = {
        "context": context,
        "rounds": rounds,
        "threads": threads,
        "target": {"path": str(target), "step_ms": round(step[0] * 1e3, 3), "macs_per_token": macs[0],
                   "parameters": params[0]},
        "drafts": [],
    }
    for i, path in enumerate(drafts, start=1):
        out["drafts"].append({
            "path": str(path),
            "layers": configs[i]["num_hidden_layers"],
            "hidden": configs[i]["hidden_size"],
            "intermediate": configs[i]["intermediate_size"],
            "tied": bool(configs[i].get("tie_word_embeddings", False)),
            "step_ms": round(step[i] * 1e3, 3),
            "macs_per_token": macs[i],
            "parameters": params[i],
            "measured_cost_ratio": round(step[0] / step[i], 2),  # target step ÷ draft step
            "mac_ratio": round(macs[0] / macs[i], 2),
            "per_round_ratios": [round(t / d, 2) for t, d in zip(times[0], times[i], strict=True)],
        })
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=target_path())
    parser.add_argument("--draft", type=Path, action="append", help="repeatable; the bundled draft by default")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--context", type=int, default=128, help="cached tokens before the timed step")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    result = measure(args.target, args.draft or [draft_path()], args.rounds, args.context, args.threads)
    sys.stdout.write(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
