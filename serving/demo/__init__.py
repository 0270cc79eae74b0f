"""The bundled demo model pair: a small Llama target and its distilled draft, trained offline on
the Python standard library, plus a held-out prompt set for benchmarks and the demo.

Other parts of specdeploy import only the helpers below; nothing here imports torch.
"""

from __future__ import annotations

from pathlib import Path

from serving.config import TOKEN_MAP_NAME
from serving.demo.prompts import CATEGORIES, Prompt, load_prompts

DEMO_DIR = Path(__file__).resolve().parent
MODELS_DIR = DEMO_DIR / "models"
# the demo draft's token map: its proposals restricted to the 1,024 most frequent tokens of the target's training
# text (serving.demo.build_token_map, serving.engine.spec.token_map), under the conventional name that
# `speculative.draft_token_map: auto` (the default) finds
DEMO_TOKEN_MAP = TOKEN_MAP_NAME

__all__ = ["CATEGORIES", "DEMO_DIR", "DEMO_TOKEN_MAP", "Prompt", "draft_path", "load_prompts", "target_path",
           "tokenizer_path"]


def target_path() -> Path:
    """Directory of the bundled target model (HF format, tokenizer included)."""
    return MODELS_DIR / "target"


def draft_path() -> Path:
    """Directory of the bundled draft model (HF format, same tokenizer as the target)."""
    return MODELS_DIR / "draft"


def tokenizer_path() -> Path:
    """Directory of the standalone demo tokenizer (also copied into both model directories)."""
    return DEMO_DIR / "tokenizer"
