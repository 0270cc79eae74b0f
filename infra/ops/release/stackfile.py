"""Rewrite ``specdeploy:release`` in a stack file, and nothing else.

Operators edit stack files by hand and review them in pull requests, so a rollout
must not reformat them: comments, key order and every other key stay byte for byte.
The common case (a rollout or rollback changes only ``active`` and ``canary_weight``)
is an in-place edit of those two scalar lines, keeping their trailing comments; any
other change to the release re-renders only the ``specdeploy:release`` block. The
result is validated with the stack schema before it atomically replaces the file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from infra.config import PROJECT, ReleaseSpec, parse_stack_mapping
from infra.ops.release.model import ReleaseError
from serving.config import ConfigError
from serving.files import atomic_write

RELEASE_KEY = f"{PROJECT}:release"
_SCALARS = ("active", "canary_weight")


def write_release(path: Path, release: ReleaseSpec) -> bool:
    """Make the stack file at ``path`` say ``release``; returns False when it already did."""
    text = path.read_text(encoding="utf-8")
    updated = render_release(text, release, source=str(path))
    if updated == text:
        return False
    atomic_write(path, updated)
    return True


def render_release(text: str, release: ReleaseSpec, source: str = "stack file") -> str:
    """``text`` with its release replaced by ``release``; checked against the schema."""
    document = _load(text, source)
    current = document["config"].get(RELEASE_KEY)
    wanted = release.model_dump(mode="json", exclude_none=True)
    if isinstance(current, dict) and _same_slots(current, wanted):
        defaults = ReleaseSpec.model_construct().model_dump(mode="json")
        changes = {k: wanted[k] for k in _SCALARS if current.get(k, defaults[k]) != wanted[k]}
        updated = _edit_scalars(text, changes, wanted, source) if changes else text
    else:
        updated = _replace_block(text, wanted, source)
    _check(document, _load(updated, source), release, source)
    return updated


def _load(text: str, source: str) -> dict[str, Any]:
    document = yaml.safe_load(text) or {}
    if not isinstance(document, dict) or not isinstance(document.get("config"), dict):
        raise ReleaseError(f"{source}: expected a top-level `config:` mapping")
    return document


def _same_slots(current: dict[str, Any], wanted: dict[str, Any]) -> bool:
    keys = (set(current) | set(wanted)) - set(_SCALARS)
    return all(current.get(k) == wanted.get(k) for k in keys)


def _block(lines: list[str]) -> tuple[int, int, re.Match[str]]:
    """(key line, end of block, key match) of ``specdeploy:release`` under ``config:``."""
    key = re.compile(rf"^(\s+)(['\"]?){re.escape(RELEASE_KEY)}\2\s*:\s*(.*?)\s*$")
    for index, line in enumerate(lines):
        match = key.match(line)
        if match is None:
            continue
        indent = len(match.group(1))
        end = last_content = index + 1
        while end < len(lines):
            stripped = lines[end].strip()
            depth = len(lines[end]) - len(lines[end].lstrip())
            if stripped and depth <= indent and not stripped.startswith("#"):
                break
            end += 1
            if stripped and depth > indent:
                last_content = end
        # Comments and blank lines after the block belong to whatever follows it.
        return index, last_content, match
    raise LookupError(RELEASE_KEY)


def _edit_scalars(text: str, changes: dict[str, Any], wanted: dict[str, Any], source: str) -> str:
    """Rewrite (or add) the scalar lines in ``changes``, keeping each line's trailing comment."""
    lines = text.splitlines(keepends=True)
    try:
        start, end, key = _block(lines)
    except LookupError:
        return _replace_block(text, wanted, source)
    indent = len(key.group(1))
    if key.group(3) and not key.group(3).startswith("#"):
        return _replace_block(text, wanted, source)  # flow style: nothing line-based to keep
    child_indent = None
    seen: dict[str, int] = {}
    for index in range(start + 1, end):
        line = lines[index]
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        depth = len(line) - len(line.lstrip())
        child_indent = depth if child_indent is None else child_indent
        if depth != child_indent:
            continue
        match = re.match(r"^(\s*)(\w+)(\s*:\s*)([^#\n]*?)(\s*#.*)?(\r?\n)?$", line)
        if match and match.group(2) in _SCALARS:
            name = match.group(2)
            seen[name] = index
            if name in changes:
                lines[index] = (f"{match.group(1)}{name}{match.group(3)}{changes[name]}"
                                f"{match.group(5) or ''}{match.group(6) or ''}")
    pad = " " * (child_indent if child_indent is not None else indent + 2)
    missing = [name for name in _SCALARS if name not in seen and name in changes]
    if missing:
        after = max(seen.values(), default=start) + 1
        newline = "\r\n" if lines[start].endswith("\r\n") else "\n"
        lines[after:after] = [f"{pad}{name}: {changes[name]}{newline}" for name in missing]
    return "".join(lines)


def _replace_block(text: str, wanted: dict[str, Any], source: str) -> str:
    lines = text.splitlines(keepends=True)
    newline = "\r\n" if lines and lines[0].endswith("\r\n") else "\n"
    try:
        start, end, key = _block(lines)
        indent = key.group(1)
        comment = key.group(3) if key.group(3).startswith("#") else ""
        head = f"{indent}{key.group(2)}{RELEASE_KEY}{key.group(2)}:" + (f" {comment}" if comment else "")
    except LookupError:  # no release yet: append it to the config mapping
        start = end = _config_end(lines)
        indent = _config_indent(lines)
        head = f"{indent}{RELEASE_KEY}:"
    dumped = yaml.safe_dump(wanted, sort_keys=False, default_flow_style=False, width=200)
    body = [f"{indent}  {line}{newline}" for line in dumped.splitlines()]
    if start > 0 and not lines[start - 1].endswith("\n"):
        lines[start - 1] += newline
    return "".join(lines[:start] + [head + newline] + body + lines[end:])


def _config_indent(lines: list[str]) -> str:
    for line in lines:
        if line.strip() and not line.lstrip().startswith("#") and line[0].isspace():
            return line[: len(line) - len(line.lstrip())]
    return "  "


def _config_end(lines: list[str]) -> int:
    """Index after the last line of the top-level ``config:`` mapping."""
    inside = False
    last = len(lines)
    for index, line in enumerate(lines):
        if re.match(r"^config\s*:", line):
            inside = True
            last = index + 1
            continue
        if inside:
            stripped = line.strip()
            if stripped and not stripped.startswith("#") and not line[0].isspace():
                break
            if stripped:
                last = index + 1
    return last


def _check(before: dict[str, Any], after: dict[str, Any], release: ReleaseSpec, source: str) -> None:
    """The edit changed the release to ``release`` and nothing else, and the stack still validates."""
    old = {k: v for k, v in before.items() if k != "config"}
    new = {k: v for k, v in after.items() if k != "config"}
    old_config = {k: v for k, v in before["config"].items() if k != RELEASE_KEY}
    new_config = {k: v for k, v in after["config"].items() if k != RELEASE_KEY}
    if old != new or old_config != new_config:
        raise ReleaseError(f"{source}: refusing to write: the edit would change more than {RELEASE_KEY}")
    try:
        config, _, _ = parse_stack_mapping(after["config"], source=source)
    except ConfigError as exc:
        raise ReleaseError(f"refusing to write an invalid stack file: {exc}") from None
    if config.release != release:
        raise ReleaseError(f"{source}: refusing to write: the edited release does not read back as intended")
