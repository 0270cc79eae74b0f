"""Kubernetes objects rebuilt from recorded Pulumi resource inputs, written as YAML.

An offline preview records every resource the program registers (type token and
inputs, as the engine would receive them). For ``kubernetes:*`` resources those
inputs *are* the object: this module restores what the recording loses — the
apiVersion/kind from the type token (``kubernetes:core/v1:Service`` -> ``v1``,
``Service``), integers that the wire format turned into floats — and writes one
file per object, ready for ``kubectl apply --dry-run=server`` or
``kubernetes-validate``. Values Pulumi marks secret are masked, never written.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

# Pulumi's wire marker for a secret value: {SECRET_SIG_KEY: SECRET_SIG, "value": ...}.
SECRET_SIG_KEY = "4dabf18193072939515e22adb298388d"
SECRET_SIG = "1b47061264138c4ac30d75fd1eb44270"
SECRET_MASK = "[secret]"

_TYPE_TOKEN = re.compile(r"^kubernetes:(?P<group_version>[A-Za-z0-9.-]+/v[0-9a-z]+):(?P<kind>[A-Z][A-Za-z0-9]*)$")
# Order objects the way they can be applied: what others reference first.
_KIND_ORDER = ("Namespace", "ServiceAccount", "Secret", "ConfigMap", "PersistentVolumeClaim", "Service",
               "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy", "Ingress")


def api_version_and_kind(type_token: str) -> tuple[str, str] | None:
    """(apiVersion, kind) of a pulumi-kubernetes type token, or None for anything else."""
    match = _TYPE_TOKEN.match(type_token)
    if match is None:
        return None
    group_version = match["group_version"]
    # The core group has no name: its objects say `apiVersion: v1`.
    api_version = group_version.removeprefix("core/")
    return api_version, match["kind"]


def restore(value: Any) -> Any:
    """Undo the wire format: floats that hold integers become ints, secrets are masked."""
    if isinstance(value, Mapping):
        if value.get(SECRET_SIG_KEY) == SECRET_SIG:
            return SECRET_MASK
        return {str(k): restore(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [restore(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def to_manifest(type_token: str, inputs: Mapping[str, Any]) -> dict[str, Any] | None:
    """The Kubernetes object for one recorded resource, or None if it is not a Kubernetes object."""
    identity = api_version_and_kind(type_token)
    if identity is None:
        return None
    api_version, kind = identity
    body = restore(inputs)
    body.pop("apiVersion", None)
    body.pop("kind", None)
    manifest: dict[str, Any] = {"apiVersion": api_version, "kind": kind}
    if "metadata" in body:
        manifest["metadata"] = body.pop("metadata")
    manifest.update(sorted(body.items()))
    return manifest


def _sort_key(manifest: Mapping[str, Any]) -> tuple[int, str, str, str]:
    kind = manifest["kind"]
    rank = _KIND_ORDER.index(kind) if kind in _KIND_ORDER else len(_KIND_ORDER)
    metadata = manifest.get("metadata") or {}
    return rank, kind, str(metadata.get("namespace", "")), str(metadata.get("name", ""))


def render_objects(records: Iterable[tuple[str, Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Kubernetes objects of (type token, inputs) records, in apply order; other resources are skipped."""
    manifests = [m for m in (to_manifest(token, inputs) for token, inputs in records) if m is not None]
    return sorted(manifests, key=_sort_key)


def manifest_filename(index: int, manifest: Mapping[str, Any]) -> str:
    metadata = manifest.get("metadata") or {}
    parts = [metadata.get("namespace"), manifest["kind"].lower(), metadata.get("name", "unnamed")]
    return f"{index:02d}-" + "-".join(str(p) for p in parts if p) + ".yaml"


def write_manifests(manifests: Iterable[Mapping[str, Any]], directory: Path) -> list[Path]:
    """One YAML file per object, numbered in apply order; returns the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, manifest in enumerate(manifests, start=1):
        path = directory / manifest_filename(index, manifest)
        path.write_text(yaml.safe_dump(dict(manifest), sort_keys=True), encoding="utf-8")
        paths.append(path)
    return paths
