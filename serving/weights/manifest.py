"""``manifest.json``: every file of a model version with its size and sha256.

A version directory is valid when it holds exactly the files its manifest lists, each with the
listed size and hash. Every failure names the file it is about.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
_CHUNK = 1 << 20
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")

ProgressFn = Callable[[int], None]


class WeightsError(Exception):
    """A model version is missing, incomplete or does not match its manifest."""


@dataclass(frozen=True)
class FileEntry:
    path: str  # POSIX path relative to the version directory
    size: int  # bytes
    sha256: str  # lowercase hex


@dataclass(frozen=True)
class Manifest:
    files: tuple[FileEntry, ...]

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files)

    def to_json(self) -> str:
        body = {
            "format": MANIFEST_FORMAT,
            "files": [{"path": e.path, "size": e.size, "sha256": e.sha256} for e in self.files],
        }
        return json.dumps(body, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, source: str = MANIFEST_NAME) -> Manifest:
        """Parse and validate; a malformed manifest is a ``WeightsError`` naming ``source``."""
        try:
            raw = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise WeightsError(f"{source}: not valid JSON ({exc})") from exc
        if not isinstance(raw, dict) or raw.get("format") != MANIFEST_FORMAT:
            raise WeightsError(f"{source}: not a manifest (expected format {MANIFEST_FORMAT})")
        files = raw.get("files")
        if not isinstance(files, list) or not files:
            raise WeightsError(f"{source}: 'files' must be a non-empty list")
        entries = [_parse_entry(item, source) for item in files]
        paths = [e.path for e in entries]
        if len(set(paths)) != len(paths):
            raise WeightsError(f"{source}: a file is listed twice")
        return cls(files=tuple(sorted(entries, key=lambda e: e.path)))


def _parse_entry(item: Any, source: str) -> FileEntry:
    if not isinstance(item, dict):
        raise WeightsError(f"{source}: every entry of 'files' must be an object")
    path, size, digest = item.get("path"), item.get("size"), item.get("sha256")
    if not isinstance(path, str) or not _is_safe_relative(path):
        raise WeightsError(f"{source}: unsafe or invalid path {path!r}")
    if path == MANIFEST_NAME:
        raise WeightsError(f"{source}: the manifest cannot list itself")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise WeightsError(f"{source}: {path}: invalid size {size!r}")
    if not isinstance(digest, str) or not _SHA256_RE.match(digest):
        raise WeightsError(f"{source}: {path}: invalid sha256 {digest!r}")
    return FileEntry(path=path, size=size, sha256=digest)


def _is_safe_relative(path: str) -> bool:
    """A canonical relative POSIX path: no absolute root, no `..`, no `.` or empty parts, no backslash.

    Canonical matters: ``./config.json`` and ``a//b`` name the same file as ``config.json`` and ``a/b``;
    accepting both spellings would let one file be listed twice under different names.
    """
    pure = PurePosixPath(path)
    if not path or pure.is_absolute() or "\\" in path or pure.as_posix() != path:
        return False
    return not any(part in ("", ".", "..") for part in path.split("/"))


def sha256_file(path: Path, progress: ProgressFn | None = None) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return digest.hexdigest()


def list_files(directory: Path) -> list[str]:
    """Every regular file under ``directory`` except the manifest, as sorted POSIX paths.

    A version directory holds regular files and directories only: a symbolic link (to a file or a
    directory, inside or outside the version) or any other kind of entry is an error naming it, so
    what is verified is exactly what the server will read.
    """
    found: list[str] = []
    for root, dirs, names in os.walk(directory):
        dirs.sort()
        for name in [*dirs, *names]:
            entry = Path(root) / name
            rel = entry.relative_to(directory).as_posix()
            mode = entry.lstat().st_mode
            if stat.S_ISLNK(mode):
                raise WeightsError(f"{rel}: is a symbolic link; a model version holds regular files only")
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise WeightsError(f"{rel}: not a regular file or directory")
            if stat.S_ISREG(mode) and rel != MANIFEST_NAME:
                found.append(rel)
    return sorted(found)


def build_manifest(directory: Path, progress: ProgressFn | None = None) -> Manifest:
    """Hash every file under ``directory`` (the manifest itself excluded)."""
    if not directory.is_dir():
        raise WeightsError(f"{directory}: not a directory")
    paths = list_files(directory)
    if not paths:
        raise WeightsError(f"{directory}: no files to put in a manifest")
    entries = []
    for rel in paths:
        file = directory / rel
        entries.append(FileEntry(path=rel, size=file.stat().st_size, sha256=sha256_file(file, progress)))
    return Manifest(files=tuple(entries))


def load_manifest(directory: Path) -> Manifest:
    path = directory / MANIFEST_NAME
    if path.is_symlink():
        raise WeightsError(f"{path}: is a symbolic link; a model version holds regular files only")
    if not path.is_file():
        raise WeightsError(f"{path}: manifest missing")
    return Manifest.from_json(path.read_bytes(), source=str(path))


def verify_file(directory: Path, entry: FileEntry, progress: ProgressFn | None = None) -> None:
    """Check one file's presence, size and hash; the error names the file."""
    file = directory / entry.path
    try:
        info = file.lstat()
    except FileNotFoundError:
        raise WeightsError(f"{entry.path}: missing") from None
    except NotADirectoryError:
        raise WeightsError(f"{entry.path}: missing (a parent is not a directory)") from None
    if stat.S_ISLNK(info.st_mode):
        raise WeightsError(f"{entry.path}: is a symbolic link; a model version holds regular files only")
    if not stat.S_ISREG(info.st_mode):
        raise WeightsError(f"{entry.path}: not a regular file")
    # A parent directory that is a link would lead outside the version: the resolved path must stay inside.
    if not file.resolve().is_relative_to(directory.resolve()):
        raise WeightsError(f"{entry.path}: resolves outside the model directory")
    size = info.st_size
    if size != entry.size:
        raise WeightsError(f"{entry.path}: size {size} bytes, manifest says {entry.size} (truncated or altered)")
    actual = sha256_file(file, progress)
    if actual != entry.sha256:
        raise WeightsError(f"{entry.path}: sha256 {actual} does not match manifest {entry.sha256}")


def verify_dir(directory: Path, manifest: Manifest | None = None, progress: ProgressFn | None = None) -> Manifest:
    """Verify ``directory`` against ``manifest`` (default: its own ``manifest.json``).

    Files the manifest does not list are an error too: a version is exactly what was pushed.
    """
    if not directory.is_dir():
        raise WeightsError(f"{directory}: not a directory")
    manifest = manifest if manifest is not None else load_manifest(directory)
    listed = {e.path for e in manifest.files}
    extra = [p for p in list_files(directory) if p not in listed]
    if extra:
        raise WeightsError(f"{extra[0]}: not listed in the manifest")
    for entry in manifest.files:
        verify_file(directory, entry, progress)
    return manifest
