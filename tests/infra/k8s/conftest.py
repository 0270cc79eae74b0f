"""Kubernetes stacks built under Pulumi mocks, every registered resource recorded.

Fixtures: ``prod`` / ``dev`` build stacks k8s-prod / k8s-dev once per test module,
lazily, from inside the first ``@pulumi.runtime.test`` that asks (resources must be
registered while the Pulumi runtime runs); later tests read the resolved outputs of
the same components. ``render(stack, config)`` builds from outside the runtime and
``variant(stack, section={...})`` changes a stack's config for one test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pytest

from infra.config import PROJECT, StackConfig, load_stack
from infra.k8s_program import KubernetesStack, build_kubernetes
from infra.k8s_render import render_objects


@dataclass(frozen=True)
class Recorded:
    type_token: str
    name: str
    inputs: dict[str, Any]


class RecordingMocks(pulumi.runtime.Mocks):
    """Returns inputs as state (no autonaming) and keeps what each resource was given."""

    def __init__(self) -> None:
        self.records: list[Recorded] = []

    def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str, dict[str, Any]]:
        self.records.append(Recorded(args.typ, args.name, dict(args.inputs)))
        return f"{args.name}-id", args.inputs

    def call(self, args: pulumi.runtime.MockCallArgs) -> dict[str, Any]:
        return {}


@dataclass
class MockStack:
    stack: KubernetesStack
    records: list[Recorded]
    exports: dict[str, Any] = field(default_factory=dict)

    @property
    def manifests(self) -> list[dict[str, Any]]:
        return render_objects((r.type_token, r.inputs) for r in self.records)

    def objects(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.manifests if m["kind"] == kind]

    def one(self, kind: str, name: str) -> dict[str, Any]:
        found = [m for m in self.objects(kind) if m["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
        return found[0]


def build(stack_name: str, config: StackConfig | None = None) -> MockStack:
    """Register the whole stack under fresh mocks. Call inside a running @pulumi.runtime.test."""
    mocks = RecordingMocks()
    pulumi.runtime.set_mocks(mocks, project=PROJECT, stack=stack_name, preview=False)
    built = build_kubernetes(config or load_stack(stack_name).config)
    result = MockStack(built, mocks.records)
    return result


def build_recorded(stack_name: str, config: StackConfig | None = None) -> MockStack:
    """Build a stack from outside the Pulumi runtime (a fixture) and resolve its exports."""
    holder: dict[str, MockStack] = {}

    @pulumi.runtime.test
    def _run() -> pulumi.Output[None]:
        built = holder["stack"] = build(stack_name, config)
        return pulumi.Output.all(**built.stack.exports()).apply(built.exports.update)

    _run()
    return holder["stack"]


def variant(stack_name: str, **sections: dict[str, Any]) -> StackConfig:
    """A stack's config with some sections updated, re-validated (e.g. kubernetes={"weight_cache": "hostPath"})."""
    config = load_stack(stack_name).config
    data = config.model_dump()
    for section, changes in sections.items():
        data[section] = {**(data.get(section) or {}), **changes}
    return StackConfig.model_validate(data)


class LazyStack:
    """One MockStack per test module, built by whichever test asks first."""

    def __init__(self, stack_name: str, config: StackConfig | None = None) -> None:
        self.stack_name = stack_name
        self.config = config
        self._built: MockStack | None = None

    def __call__(self) -> MockStack:
        if self._built is None:
            self._built = build(self.stack_name, self.config)
        return self._built


@pytest.fixture(scope="module")
def prod() -> LazyStack:
    return LazyStack("k8s-prod")


@pytest.fixture(scope="module")
def dev() -> LazyStack:
    return LazyStack("k8s-dev")


@pytest.fixture
def render() -> Callable[..., MockStack]:
    return build_recorded


@pytest.fixture
def variant_config() -> Callable[..., StackConfig]:
    return variant
