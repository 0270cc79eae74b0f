"""Model versions: a directory plus ``manifest.json``; push, pull and verify against a store."""

from serving.weights.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    WeightsError,
    build_manifest,
    load_manifest,
    verify_dir,
)
from serving.weights.store import ObjectStore, open_store
from serving.weights.transfer import ensure_local, pull, push

__all__ = [
    "MANIFEST_NAME",
    "FileEntry",
    "Manifest",
    "ObjectStore",
    "WeightsError",
    "build_manifest",
    "ensure_local",
    "load_manifest",
    "open_store",
    "pull",
    "push",
    "verify_dir",
]
