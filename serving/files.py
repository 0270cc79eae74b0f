"""Writing a file whole or not at all, shared by the server's tools and the deployment tooling."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write(path: Path, text: str) -> None:
    """Write to a temporary file beside ``path``, fsync, then rename over it: a reader sees the old file or the
    new one, never part of one. Keeps an existing file's mode; a new one gets 0644 (mkstemp alone makes 0600,
    which a server running as another user could not read)."""
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
