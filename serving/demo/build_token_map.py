"""The demo draft's token map: the most frequent tokens of the corpus the demo target was trained on.

    python -m serving.demo.build_token_map [--size 1024] [--out serving/demo/models/draft/token_map.json]

`speculative.draft_token_map: token_map.json` (the local stacks, `specdeploy bench spec` with the demo draft)
then restricts the draft's proposals and lm_head to these tokens (serving.engine.spec.token_map). Over 48
held-out code windows, the demo target's greedy continuations (6,144 tokens) fell inside the 1,024 most
frequent training-split tokens 98.8 % of the time (2,048: 99.6 %); docs/engine.md has the choice of size.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from serving.demo import DEMO_TOKEN_MAP, corpus
from serving.demo.training import MODELS_DIR, encode_files
from serving.engine.spec.token_map import most_frequent, write_token_map

DEFAULT_SIZE = 1024
DEFAULT_OUT = MODELS_DIR / "draft" / DEMO_TOKEN_MAP


def build(size: int = DEFAULT_SIZE, out: Path = DEFAULT_OUT, target: Path = MODELS_DIR / "target") -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    train, _ = corpus.split()
    ids = most_frequent([encode_files(tokenizer, train)], size, len(tokenizer))
    write_token_map(ids, out)
    return ids


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m serving.demo.build_token_map")
    parser.add_argument("--size", type=int, default=DEFAULT_SIZE, help=f"tokens in the map (default {DEFAULT_SIZE})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write it")
    args = parser.parse_args(argv)
    if args.size < 1:
        parser.error("--size must be a positive integer")
    ids = build(args.size, args.out)
    sys.stdout.write(f"{args.out}: {len(ids)} token ids\n")


if __name__ == "__main__":
    main()
