"""Where the project and its stack files are: the Pulumi project directory, as the `pulumi` command finds it."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from serving.config import ConfigError

PROJECT = "specdeploy"
# The source checkout this package sits in: only for in-repo resources (the config reference
# generator). Stack files come from the user's Pulumi project, see :func:`project_dir`.
REPO_ROOT = Path(__file__).resolve().parents[2]
PROJECT_FILE = "Pulumi.yaml"


# `specdeploy --project DIR` pins the project; otherwise it is found from the working directory.
_pinned_project: Path | None = None


def find_project_dir(start: Path) -> Path:
    """The Pulumi project ``start`` is in: ``start`` or its nearest parent holding a Pulumi.yaml,
    as the ``pulumi`` command finds it."""
    start = start.resolve()
    for directory in (start, *start.parents):
        if (directory / PROJECT_FILE).is_file():
            return directory
    raise ConfigError(f"no {PROJECT_FILE} in {start} or any parent; run inside a specdeploy project "
                      "or pass --project DIR")


def use_project(directory: Path | None) -> None:
    """Pin the project directory for this process (``--project DIR``); None finds it from the cwd again."""
    global _pinned_project
    if directory is not None and not (directory / PROJECT_FILE).is_file():
        raise ConfigError(f"--project {directory}: no {PROJECT_FILE} there")
    _pinned_project = directory.resolve() if directory is not None else None


def project_dir() -> Path:
    """The Pulumi project: pinned by ``--project``, else found upward from the working directory."""
    return _pinned_project or find_project_dir(Path.cwd())


def project_stacks_dir(project: Path | None = None) -> Path:
    """Where the project's stack files live: Pulumi.yaml's ``stackConfigDir``, default the project itself."""
    project = project or project_dir()
    path = project / PROJECT_FILE
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: expected a mapping")
    configured = document.get("stackConfigDir")
    if configured is None:
        return project
    if not isinstance(configured, str) or not configured:
        raise ConfigError(f"{path}: stackConfigDir must be a directory path, got {configured!r}")
    return project / configured


def stack_path(name: str, stacks_dir: Path | None = None) -> Path:
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise ConfigError(f"invalid stack name {name!r}")
    return (stacks_dir or project_stacks_dir()) / f"Pulumi.{name}.yaml"


def available_stacks(stacks_dir: Path | None = None) -> list[str]:
    directory = stacks_dir or project_stacks_dir()
    return sorted(p.name[len("Pulumi.") : -len(".yaml")] for p in directory.glob("Pulumi.*.yaml"))
