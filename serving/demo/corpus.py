"""The offline training corpus: the running interpreter's standard library sources.

Every file is named by its path relative to the stdlib root, so the split is the same on any
machine with the same Python version. About 3 % of the files are held out by a seeded hash of
that path; the held-out list is committed next to this module (``heldout_files.txt``) and is
never trained on, by the tokenizer, the target or the draft.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator
from pathlib import Path

SPLIT_SEED = 1234
HELDOUT_FRACTION = 0.03
HELDOUT_LIST = Path(__file__).with_name("heldout_files.txt")

# Directory names anywhere in the path that hold tests.
_TEST_DIRS = {"test", "tests", "idle_test"}
# Top-level stdlib entries that are not "code people write": generated codec tables, pydoc's
# topic dump, third-party packages, build configuration.
_EXCLUDED_TOP = {"encodings", "pydoc_data", "site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_corpus_file(rel: Path) -> bool:
    parts = rel.parts
    if parts[0] in _EXCLUDED_TOP or parts[0].startswith("config-"):
        return False
    if any(part in _TEST_DIRS for part in parts[:-1]):
        return False
    name = rel.name
    return not (name.startswith("test_") or name.startswith("_sysconfigdata"))


def corpus_files(root: Path | None = None) -> list[str]:
    """All corpus files as sorted POSIX paths relative to the stdlib root."""
    root = root or stdlib_root()
    rels = (p.relative_to(root) for p in root.rglob("*.py") if p.is_file())
    return sorted(rel.as_posix() for rel in rels if _is_corpus_file(rel))


def is_heldout(rel_path: str, seed: int = SPLIT_SEED, fraction: float = HELDOUT_FRACTION) -> bool:
    """Deterministic, path-keyed split: stable when files are added or removed elsewhere."""
    digest = hashlib.sha256(f"{seed}:{rel_path}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def committed_heldout() -> list[str]:
    if not HELDOUT_LIST.exists():
        return []
    lines = HELDOUT_LIST.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def split(root: Path | None = None) -> tuple[list[str], list[str]]:
    """(train, heldout). Files in the committed held-out list are never in train."""
    files = corpus_files(root)
    pinned = set(committed_heldout())
    heldout = [f for f in files if is_heldout(f) or f in pinned]
    held = set(heldout)
    return [f for f in files if f not in held], heldout


def write_heldout_list(heldout: list[str], path: Path = HELDOUT_LIST) -> None:
    header = f"# held-out stdlib files (relative to the stdlib root), seed {SPLIT_SEED}, never trained on\n"
    path.write_text(header + "".join(f"{f}\n" for f in heldout), encoding="utf-8")


def read_texts(rel_paths: list[str], root: Path | None = None) -> Iterator[str]:
    root = root or stdlib_root()
    for rel in rel_paths:
        path = root / rel
        if path.exists():
            yield path.read_text(encoding="utf-8", errors="replace")
