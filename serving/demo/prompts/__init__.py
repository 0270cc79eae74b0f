"""Held-out prompt set for benchmarks and the demo: one JSONL file per category.

Each line: ``{"id": str, "category": str, "prompt": str, "max_tokens": int}``; chat-style
prompts also carry ``"messages"`` (OpenAI-style list) so a server's chat endpoint can be used.
Code prompts are prefixes cut from held-out stdlib files (see ``build_prompts``), so speculation
on them measures generalisation, not memorisation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

PROMPTS_DIR = Path(__file__).resolve().parent
# code is predictable for a draft; open-ended prose much less so.
CATEGORIES = ("code", "chat", "extraction", "writing")


@dataclass(frozen=True)
class Prompt:
    id: str  # unique across the set, e.g. "code-007"
    category: str  # one of CATEGORIES
    prompt: str  # raw completion prompt (for chat prompts: the rendered user text)
    max_tokens: int  # generation budget used by benchmarks
    messages: list[dict[str, str]] = field(default_factory=list)  # chat form, empty for code
    source: str = ""  # held-out file a code prompt was cut from


def prompt_file(category: str) -> Path:
    return PROMPTS_DIR / f"{category}.jsonl"


def load_prompts(category: str | None = None) -> list[Prompt]:
    """All prompts of one category, or of every category (in CATEGORIES order) when None."""
    if category is not None and category not in CATEGORIES:
        raise ValueError(f"unknown prompt category {category!r}; expected one of {', '.join(CATEGORIES)}")
    prompts: list[Prompt] = []
    for cat in [category] if category else CATEGORIES:
        with prompt_file(cat).open(encoding="utf-8") as fh:
            prompts.extend(Prompt(**json.loads(line)) for line in fh if line.strip())
    return prompts
