"""infra/__main__.py on every AWS stack: wiring, component conventions, exports, platform branches."""

from __future__ import annotations

import re
from collections.abc import Callable

import pulumi
import pytest

from infra.alerts import alert_rules
from infra.config import load_stack
from infra.program.preview import PreviewResult, record_stack

StackFn = Callable[[str], PreviewResult]
STACKS = ("dev", "staging", "prod")
COMPONENTS = {"ModelStore", "Network", "ImageRepository", "ApiKeySecret", "LoadBalancer", "GpuFleet", "Alerting",
              "ReleaseOperatorPolicy"}


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_stack_builds_every_component(stack: str, aws_stack: StackFn) -> None:
    tokens = {r.type for r in aws_stack(stack).resources if not r.custom}
    assert tokens == {f"specdeploy:aws:{name}" for name in COMPONENTS}


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_every_resource_belongs_to_a_component(stack: str, aws_stack: StackFn) -> None:
    result = aws_stack(stack)
    components = {r.name for r in result.resources if not r.custom}
    assert {r.parent for r in result.resources if r.custom} <= components


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_child_names_derive_from_their_component(stack: str, aws_stack: StackFn) -> None:
    result = aws_stack(stack)
    assert all(r.name.startswith(f"{r.parent}-") for r in result.resources if r.custom)


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_exports_name_what_operators_and_releases_read(stack: str, aws_stack: StackFn) -> None:
    exports = aws_stack(stack).exports
    assert {"endpoint", "load_balancer_dns", "model_bucket", "target_group_arns", "listener_arn", "alarm_names",
            "active_slot"} <= set(exports)


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_exported_alarm_names_cover_the_alert_set(stack: str, aws_stack: StackFn) -> None:
    names = aws_stack(stack).exports["alarm_names"]  # slot -> its alarms, one per rule
    slots = [s for s in ("blue", "green") if load_stack(stack).config.slots.slot(s) is not None]
    assert sorted(names) == slots
    for slot in slots:
        assert sorted(names[slot]) == sorted(f"{stack}-{slot}-{r.name}" for r in alert_rules(load_stack(stack).config))


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_exported_target_groups_are_blue_and_green(stack: str, aws_stack: StackFn) -> None:
    assert sorted(aws_stack(stack).exports["target_group_arns"]) == ["blue", "green"]


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_exported_active_slot_is_the_stacks(stack: str, aws_stack: StackFn) -> None:
    assert aws_stack(stack).exports["active_slot"] == load_stack(stack).config.slots.active


@pulumi.runtime.test
def test_internal_endpoint_is_plain_http_on_the_alb(aws_stack: StackFn) -> None:
    assert re.fullmatch(r"http://internal-.*\.elb\.amazonaws\.com", aws_stack("dev").exports["endpoint"])


@pulumi.runtime.test
def test_a_defined_green_slot_gets_its_own_fleet(aws_variant: Callable[..., PreviewResult]) -> None:
    release = load_stack("staging").config.slots.model_dump(mode="json")
    release["green"] = release["blue"]
    result = aws_variant("staging", release=release)
    assert sorted(result.exports["asg_names"]) == ["blue", "green"]


@pulumi.runtime.test
def test_a_model_that_does_not_fit_stops_the_program(aws_variant: Callable[..., PreviewResult]) -> None:
    with pytest.raises(Exception, match="does not fit fleet.instance_type g5.2xlarge"):
        aws_variant("dev", fleet={"instance_type": "g5.2xlarge"})


def test_local_platform_points_at_the_local_path() -> None:
    with pytest.raises(RuntimeError, match="specdeploy up --stack local"):
        record_stack("local")
