"""Push a version directory to a store and pull it back, verified, into a local cache.

push: every file in parallel (multipart for large ones), the manifest last, so a reader that
sees a manifest sees a complete version. pull: into a temporary directory beside the target,
verify every hash, then rename into place; any failure removes the temporary directory, so the
cache never holds a partial version.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from serving.weights.manifest import (
    MANIFEST_NAME,
    Manifest,
    WeightsError,
    build_manifest,
    load_manifest,
    verify_dir,
)
from serving.weights.store import DIR_MODE, FILE_MODE, ObjectStore, open_store

logger = logging.getLogger(__name__)

PARALLEL_FILES = 4


class TransferProgress(Protocol):
    """What the CLI's progress bar implements; callbacks may come from worker threads."""

    def begin(self, description: str, total_bytes: int) -> None: ...

    def advance(self, nbytes: int) -> None: ...


class _NoProgress:
    def begin(self, description: str, total_bytes: int) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        pass


@dataclass(frozen=True)
class PullResult:
    path: Path
    manifest: Manifest
    fetched: bool  # False: the verified version was already in place


def push(
    directory: Path,
    uri: str,
    endpoint_url: str | None = None,
    progress: TransferProgress | None = None,
) -> Manifest:
    progress = progress or _NoProgress()
    progress.begin("hashing", _dir_bytes(directory))
    manifest = build_manifest(directory, progress.advance)
    store = open_store(uri, endpoint_url)
    progress.begin("uploading", manifest.total_bytes)
    with ThreadPoolExecutor(max_workers=PARALLEL_FILES) as pool:
        futures = [
            pool.submit(store.upload, directory / entry.path, entry.path, progress.advance) for entry in manifest.files
        ]
        for future in futures:
            future.result()
    store.put_bytes(MANIFEST_NAME, manifest.to_json().encode())
    logger.info("pushed %d files (%d bytes) to %s", len(manifest.files), manifest.total_bytes, uri)
    return manifest


def pull(
    uri: str,
    target: Path,
    endpoint_url: str | None = None,
    progress: TransferProgress | None = None,
) -> PullResult:
    progress = progress or _NoProgress()
    store = open_store(uri, endpoint_url)
    remote = Manifest.from_json(store.get_bytes(MANIFEST_NAME), source=f"{uri.rstrip('/')}/{MANIFEST_NAME}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with _pull_lock(target):
        if _already_verified(target, remote, progress):
            logger.info("%s already holds the verified version from %s", target, uri)
            return PullResult(target, remote, fetched=False)
        _remove_stale_staging(target)
        _fetch_verified(store, remote, target, progress)
    logger.info("pulled %d files (%d bytes) from %s into %s", len(remote.files), remote.total_bytes, uri, target)
    return PullResult(target, remote, fetched=True)


@contextlib.contextmanager
def _pull_lock(target: Path) -> Iterator[None]:
    """One pull of ``target`` at a time, across processes and across hosts sharing the volume.

    POSIX record locks (``lockf``) are honoured by NFSv4 (EFS) as well as local filesystems; the
    kernel drops the lock when its holder dies, so a killed pull never blocks the next one.
    """
    lock_path = target.parent / f".{target.name}.lock"
    with lock_path.open("a+b") as handle:
        fcntl.lockf(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(handle, fcntl.LOCK_UN)


def _remove_stale_staging(target: Path) -> None:
    """Staging and retired directories of ``target`` left by a pull that was killed (called under the lock:
    no live pull of this target owns one)."""
    for prefix in (f".{target.name}.partial-", f".{target.name}.old-"):
        for stale in target.parent.glob(f"{prefix}*"):
            if stale.is_dir() and not stale.is_symlink():
                logger.warning("removing %s left by an interrupted pull", stale)
                shutil.rmtree(stale, ignore_errors=True)


def _fetch_verified(store: ObjectStore, remote: Manifest, target: Path, progress: TransferProgress) -> None:
    """Download every file into a staging directory beside ``target``, verify, rename into place."""
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.partial-"))
    try:
        progress.begin("downloading", remote.total_bytes)
        with ThreadPoolExecutor(max_workers=PARALLEL_FILES) as pool:
            futures = [
                pool.submit(store.download, entry.path, staging / entry.path, progress.advance)
                for entry in remote.files
            ]
            for future in futures:
                future.result()
        progress.begin("verifying", remote.total_bytes)
        verify_dir(staging, remote, progress.advance)
        (staging / MANIFEST_NAME).write_text(remote.to_json())
        make_readable(staging)
        _swap_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def ensure_local(path: Path, source_uri: str | None = None, endpoint_url: str | None = None) -> Manifest:
    """What the server runs at start: pull ``source_uri`` into ``path`` if given, else verify ``path``."""
    if source_uri:
        return pull(source_uri, path, endpoint_url).manifest
    return verify_dir(path)


def _already_verified(target: Path, remote: Manifest, progress: TransferProgress) -> bool:
    if not (target / MANIFEST_NAME).is_file():
        return False
    try:
        if load_manifest(target) != remote:
            return False
        progress.begin("verifying cached", remote.total_bytes)
        verify_dir(target, remote, progress.advance)
    except WeightsError as exc:
        logger.warning("cached version at %s is not valid, pulling again: %s", target, exc)
        return False
    return True


def make_readable(root: Path) -> None:
    """Directories 0755 and files 0644 (mkdtemp makes 0700): a server of another uid reads the weights."""
    root.chmod(DIR_MODE)
    for path in root.rglob("*"):
        if not path.is_symlink():
            path.chmod(DIR_MODE if path.is_dir() else FILE_MODE)


def _swap_into_place(staging: Path, target: Path) -> None:
    """Rename ``staging`` to ``target``; an existing (stale) ``target`` is moved aside first."""
    if not target.exists():
        os.rename(staging, target)
        return
    retired = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old-"))
    os.rename(target, retired / "version")
    os.rename(staging, target)
    shutil.rmtree(retired, ignore_errors=True)


def _dir_bytes(directory: Path) -> int:
    if not directory.is_dir():
        raise WeightsError(f"{directory}: not a directory")
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
