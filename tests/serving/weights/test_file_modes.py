"""Pushed and pulled weights are readable by a server of another uid (the image's user), whatever the umask."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from serving.weights import pull, push


@pytest.fixture
def strict_umask() -> Iterator[None]:
    """Root's umask on a hardened host: without explicit modes, files come out 0600 and directories 0700."""
    previous = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(previous)


def _modes(root: Path) -> dict[str, int]:
    return {str(path.relative_to(root)): stat.S_IMODE(path.stat().st_mode) for path in [root, *root.rglob("*")]}


def test_pulled_version_has_world_readable_files_and_traversable_dirs(
    model_dir: Path, tmp_path: Path, strict_umask: None
) -> None:
    uri = f"file://{tmp_path / 'store' / 'v1'}"
    push(model_dir, uri)
    target = tmp_path / "cache" / "target"
    pull(uri, target)
    modes = _modes(target)
    assert modes["."] == 0o755
    assert modes["tokenizer"] == 0o755
    assert {name: mode for name, mode in modes.items() if (target / name).is_file()} == {
        "config.json": 0o644, "model.safetensors": 0o644, "manifest.json": 0o644, "tokenizer/vocab.txt": 0o644,
    }


def test_pushed_files_in_a_file_store_are_world_readable(model_dir: Path, tmp_path: Path, strict_umask: None) -> None:
    root = tmp_path / "store" / "v1"
    push(model_dir, f"file://{root}")
    files = {name: mode for name, mode in _modes(root).items() if (root / name).is_file()}
    assert files and set(files.values()) == {0o644}, files
