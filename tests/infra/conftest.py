"""AWS stacks built under Pulumi's mocks engine (infra/program/preview.py), shared by tests/infra.

``aws_stack("prod")`` runs infra/__main__.py for stacks/Pulumi.prod.yaml and returns every
registered resource with its inputs and mocked outputs (secrets masked) and the resolved
exports. Call it from a ``@pulumi.runtime.test``: the first test that asks builds the stack
inside its runtime (config and mocks are context variables) and waits for every
registration; later tests, in any module, read the same recording.
``aws_variant("dev", fleet={...})`` builds a copy of a stack with sections changed, for the
cases the stack files do not cover (spot capacity, an existing VPC, ...).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.config import PROJECT, project_stacks_dir
from infra.program.preview import PreviewResult, record_in_runtime

AWS_STACKS = ("dev", "staging", "prod")


@functools.cache
def _recorded(stack: str) -> PreviewResult:
    return record_in_runtime(stack)


@pytest.fixture(scope="session")
def aws_stack() -> Callable[[str], PreviewResult]:
    return _recorded


def write_variant(directory: Path, stack: str, **sections: Any) -> Path:
    """A copy of stacks/Pulumi.<stack>.yaml in `directory` with whole sections replaced or merged."""
    document = yaml.safe_load((project_stacks_dir() / f"Pulumi.{stack}.yaml").read_text())
    for section, value in sections.items():
        key = f"{PROJECT}:{section}"
        current = document["config"].get(key)
        if isinstance(value, dict) and isinstance(current, dict):
            document["config"][key] = {**current, **value}
        elif value is None:
            document["config"].pop(key, None)
        else:
            document["config"][key] = value
    path = directory / f"Pulumi.{stack}.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return directory


@pytest.fixture
def aws_variant(tmp_path: Path) -> Callable[..., PreviewResult]:
    def build(stack: str, **sections: Any) -> PreviewResult:
        return record_in_runtime(stack, write_variant(tmp_path, stack, **sections))

    return build
