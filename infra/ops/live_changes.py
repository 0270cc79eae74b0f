"""Which changes of a stack file reach the slots carrying traffic at the next `pulumi up` — without a canary.

A release changes the idle slot and reaches traffic through `specdeploy rollout`. An edit of the stack's own
`scheduler` / `speculative` sections, or of the active slot's image, weights, AMI or `server` keys, rewrites
the active slot's instances or pods directly. `specdeploy preview --against REF` compares the stack file with
its version at git REF (the deployed one, e.g. origin/main) and names each such change, so that a review sees
it; the change is not refused (a hotfix may need it).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from infra.config import SLOTS, ConfigError, StackConfig, parse_stack_mapping, render_server_config


@dataclass(frozen=True)
class LiveChange:
    slot: str  # a slot that carries traffic in the earlier version
    key: str  # dotted: server.scheduler.max_concurrency, or release.<slot>.image ...
    before: Any
    after: Any

    def describe(self) -> str:
        return f"{self.key}: {self.before!r} -> {self.after!r}"


def live_changes(before: StackConfig, after: StackConfig) -> list[LiveChange]:
    """Changes between two versions of a stack that the slots carrying traffic (in `before`) would serve."""
    found: list[LiveChange] = []
    for slot in SLOTS:
        old_spec, new_spec = before.slots.slot(slot), after.slots.slot(slot)
        if old_spec is None or new_spec is None or not before.slots.carries_traffic(slot):
            continue
        for name in ("image", "model_version", "draft_version", "ami"):
            if getattr(old_spec, name) != getattr(new_spec, name):
                found.append(LiveChange(slot, f"release.{slot}.{name}", getattr(old_spec, name),
                                        getattr(new_spec, name)))
        old_server = _served(before, slot)
        new_server = _served(after, slot)
        for key in sorted(set(old_server) | set(new_server)):
            if old_server.get(key) != new_server.get(key):
                found.append(LiveChange(slot, f"server.{key}", old_server.get(key), new_server.get(key)))
    return found


def _served(config: StackConfig, slot: str) -> dict[str, Any]:
    """The slot's rendered server config, flattened to dotted keys."""
    data = render_server_config(config.for_slot(slot)).model_dump(mode="json")
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = value

    walk("", data)
    return flat


def stack_at(ref: str, path: Path) -> StackConfig:
    """The stack file at `path` as git revision `ref` has it."""
    path = path.resolve()
    try:
        root = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=path.parent, capture_output=True,
                              text=True, check=True).stdout.strip()
        relative = path.relative_to(Path(root).resolve())
        text = subprocess.run(["git", "show", f"{ref}:{relative.as_posix()}"], cwd=root, capture_output=True,
                              text=True, check=True).stdout
    except (OSError, ValueError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        raise ConfigError(f"--against {ref}: cannot read {path.name} at that revision: {detail.strip()}") from None
    document = yaml.safe_load(text) or {}
    if not isinstance(document, dict) or not isinstance(document.get("config"), dict):
        raise ConfigError(f"--against {ref}: {path.name} there has no `config:` mapping")
    config, _, _ = parse_stack_mapping(document["config"], source=f"{ref}:{path.name}")
    return config
