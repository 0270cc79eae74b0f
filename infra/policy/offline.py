"""Run the pack's policies over resources recorded by the offline preview (no Pulumi CLI).

The same callables `pulumi preview --policy-pack infra/policy` runs, handed the recorded
properties (inputs plus what the mocks answered, e.g. ARNs and bucket names) the way
CrossGuard hands them over. Used by `specdeploy preview` and the policy tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pulumi_policy import (
    Policy,
    PolicyCustomTimeouts,
    PolicyResource,
    PolicyResourceOptions,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)

from infra.policy.aws_policies import POLICIES
from infra.program.preview import RecordedResource


@dataclass(frozen=True)
class Violation:
    policy: str
    message: str
    urn: str | None


def urn_of(resource: RecordedResource, stack: str = "preview") -> str:
    return f"urn:pulumi:{stack}::specdeploy::{resource.type}::{resource.name}"


def props_of(resource: RecordedResource) -> dict[str, Any]:
    return {**resource.inputs, **resource.outputs}


def _options() -> PolicyResourceOptions:
    return PolicyResourceOptions(protect=False, ignore_changes=[], delete_before_replace=None, aliases=[],
                                 custom_timeouts=PolicyCustomTimeouts(0, 0, 0), additional_secret_outputs=[])


def resource_args(resource: RecordedResource, props: dict[str, Any] | None = None) -> ResourceValidationArgs:
    return ResourceValidationArgs(resource.type, props if props is not None else props_of(resource),
                                  urn_of(resource), resource.name, _options(), None)


def stack_args(resources: Sequence[RecordedResource],
               props: dict[str, dict[str, Any]] | None = None) -> StackValidationArgs:
    """Stack view of the resources; `props` overrides the properties of resources by name."""
    overrides = props or {}
    return StackValidationArgs([
        PolicyResource(r.type, overrides.get(r.name, props_of(r)), urn_of(r), r.name, _options(), None, None, [], {})
        for r in resources if r.custom
    ])


def run_policy(policy: Policy, resources: Sequence[RecordedResource],
               props: dict[str, dict[str, Any]] | None = None) -> list[Violation]:
    """Violations of one policy over `resources`, with optional per-name property overrides."""
    found: list[Violation] = []

    def reporter(default_urn: str | None) -> Callable[..., None]:
        def report(message: str, urn: str | None = None) -> None:
            found.append(Violation(policy.name, message, urn or default_urn))

        return report

    if isinstance(policy, StackValidationPolicy):
        if policy.validate is not None:
            policy.validate(stack_args(resources, props), reporter(None))
        return found
    assert isinstance(policy, ResourceValidationPolicy)
    callbacks = policy.validate if isinstance(policy.validate, list) else [policy.validate]
    for resource in resources:
        if not resource.custom:
            continue
        args = resource_args(resource, (props or {}).get(resource.name))
        for callback in callbacks:
            if callback is not None:
                callback(args, reporter(urn_of(resource)))
    return found


def check(resources: Sequence[RecordedResource]) -> list[Violation]:
    """Every violation of every policy in the pack."""
    return [v for policy in POLICIES for v in run_policy(policy, resources)]
