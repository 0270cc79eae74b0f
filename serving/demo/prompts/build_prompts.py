"""Regenerate the prompt set: code prefixes cut from held-out files, plus the hand-written sets.

    python -m serving.demo.prompts.build_prompts

Code prompts end right after a ``def`` line (and its docstring's opening line when there is
one), so the model's job is to write a function body it has never seen. Selection is
deterministic: held-out files in sorted order, at most two functions per file.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from dataclasses import asdict
from pathlib import Path

from serving.demo import corpus
from serving.demo.prompts import PROMPTS_DIR, Prompt

log = logging.getLogger(__name__)

CONTEXT_LINES = 24
PER_FILE = 2
CODE_MAX_TOKENS = 128
_DEF = re.compile(r"^\s*(async\s+)?def \w+\(.*\).*:\s*$")

CHAT = [
    "What is the difference between a list and a tuple in Python?",
    "How do I read a file line by line?",
    "Explain what a context manager is, with a short example.",
    "Why does my recursive function hit the recursion limit?",
    "How can I sort a dictionary by its values?",
    "What does the `yield` keyword do?",
    "Can you suggest a name for a function that parses dates?",
    "How should I structure a small command-line tool?",
]
EXTRACTION = [
    'Extract the name and email as JSON from: "Contact Ada Lovelace at ada@example.org for details."',
    'Return a JSON object with keys city and date from: "The meeting moves to Lisbon on 2024-05-17."',
    "List every function name defined in this code as a JSON array:\n\ndef load(path):\n    ...\n\n"
    "def save(obj, path):\n    ...\n",
    'Extract the HTTP status code and path as JSON from the log line: "GET /v1/models 200 12ms".',
    'Give the version numbers mentioned, as a JSON list: "Upgrade from 3.10.4 to 3.11.7 before 2.0."',
    'Turn this into JSON with fields product, quantity, price: "3 x keyboard at 49.90 each".',
]
WRITING = [
    "Write a short poem about autumn in a harbour town.",
    "Tell a story about a lighthouse keeper who finds a message in a bottle.",
    "Describe your ideal weekend in a few sentences.",
    "Write a letter to a friend you have not seen in ten years.",
    "Invent a myth that explains why the sea is salty.",
    "Write the opening paragraph of a detective novel set on a train.",
]


def code_prompts(root: Path | None = None) -> list[Prompt]:
    root = root or corpus.stdlib_root()
    prompts: list[Prompt] = []
    for rel in corpus.committed_heldout():
        path = root / rel
        if not path.exists():
            continue
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        taken = 0
        for i, line in enumerate(lines):
            if taken == PER_FILE or i < 8 or not _DEF.match(line):
                continue
            end = i + 1
            if end < len(lines) and lines[end].strip().startswith(('"""', "'''")):
                end += 1
            prefix = "".join(lines[max(0, end - CONTEXT_LINES) : end])
            prompts.append(Prompt(f"code-{len(prompts):03d}", "code", prefix, CODE_MAX_TOKENS, source=rel))
            taken += 1
    return prompts


def chat_prompts(category: str, texts: list[str], max_tokens: int) -> list[Prompt]:
    return [
        Prompt(f"{category}-{i:03d}", category, text, max_tokens, messages=[{"role": "user", "content": text}])
        for i, text in enumerate(texts)
    ]


def write(prompts: list[Prompt], out_dir: Path) -> None:
    by_category: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_category.setdefault(p.category, []).append(p)
    for category, items in by_category.items():
        lines = [json.dumps({k: v for k, v in asdict(p).items() if v not in ("", [])}) for p in items]
        (out_dir / f"{category}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        log.info("%s: %d prompts", category, len(items))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROMPTS_DIR)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    prompts = (
        code_prompts()
        + chat_prompts("chat", CHAT, 128)
        + chat_prompts("extraction", EXTRACTION, 96)
        + chat_prompts("writing", WRITING, 128)
    )
    write(prompts, args.out)


if __name__ == "__main__":
    main()
