"""Issue 13 item 2: the AMI belongs to a slot. A new GPU AMI in SSM lands on the idle slot only; the
slot carrying traffic keeps its launch template until a rollout moves traffic to the refreshed slot."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pulumi
import pytest

from infra.config import load_stack
from infra.ops import preview
from infra.ops.preview import PreviewResult
from tests.infra.conftest import write_variant
from tests.infra.pulumi_up import LAUNCH_TEMPLATE, key, planned_updates

OLD_AMI, NEW_AMI = "ami-0aaaaaaaaaaaaaaa1", "ami-0bbbbbbbbbbbbbbb2"


def _with_ssm_ami(monkeypatch: pytest.MonkeyPatch, ami: str) -> None:
    real = preview._invoke_result

    def answer(token: str, args: dict[str, Any]) -> dict[str, Any]:
        if token == "aws:ssm/getParameter:getParameter":
            return {"name": args.get("name"), "type": "String", "value": ami, "insecureValue": ami}
        return real(token, args)

    monkeypatch.setattr(preview, "_invoke_result", answer)


def _two_slots(tmp_path: Path, **release: Any) -> Path:
    current = load_stack("staging").config.slots.model_dump(mode="json", exclude_none=True)
    return write_variant(tmp_path, "staging", release={**current, "green": current["blue"], **release})


def _template(result: PreviewResult, slot: str) -> Any:
    return result.one(LAUNCH_TEMPLATE, f"fleet-{slot}-lt")


@pulumi.runtime.test
def test_a_new_ssm_ami_leaves_the_active_slots_launch_template_unchanged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stacks = _two_slots(tmp_path, active="blue", canary_weight=0)
    _with_ssm_ami(monkeypatch, OLD_AMI)
    before = preview.record_in_runtime("staging", stacks)
    _with_ssm_ami(monkeypatch, NEW_AMI)
    after = preview.record_in_runtime("staging", stacks)
    assert _template(after, "blue").inputs["imageId"] == NEW_AMI  # what SSM says now...
    updates = planned_updates(before, after)
    assert key(LAUNCH_TEMPLATE, "fleet-blue-lt") not in updates  # ...is not applied to the slot with traffic
    assert updates[key(LAUNCH_TEMPLATE, "fleet-green-lt")] == {"imageId": NEW_AMI}  # the idle slot takes it


@pulumi.runtime.test
def test_a_canary_slot_carries_traffic_and_keeps_its_ami_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stacks = _two_slots(tmp_path, active="blue", canary_weight=10)
    _with_ssm_ami(monkeypatch, OLD_AMI)
    before = preview.record_in_runtime("staging", stacks)
    _with_ssm_ami(monkeypatch, NEW_AMI)
    updates = planned_updates(before, preview.record_in_runtime("staging", stacks))
    assert not [k for k in updates if k.startswith(LAUNCH_TEMPLATE)]


@pulumi.runtime.test
def test_a_slot_pins_its_own_ami(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 aws_variant: Callable[..., PreviewResult]) -> None:
    current = load_stack("staging").config.slots.model_dump(mode="json", exclude_none=True)
    pinned = {**current["blue"], "ami": "ami-0123456789abcdef1"}
    _with_ssm_ami(monkeypatch, NEW_AMI)
    result = aws_variant("staging", release={**current, "green": pinned})
    assert _template(result, "green").inputs["imageId"] == "ami-0123456789abcdef1"
    assert _template(result, "green").ignore_changes == ()  # a pinned AMI changes only by editing the slot
    assert _template(result, "blue").inputs["imageId"] == NEW_AMI


def test_a_slot_ami_must_be_an_ami_id() -> None:
    from infra.config import SlotSpec

    with pytest.raises(ValueError, match="ami"):
        SlotSpec.model_validate({"image": "x", "model_version": "s3://b/m", "ami": "ubuntu-latest"})
