"""Issue 13 item 2: the AMI belongs to a slot. A new GPU AMI in SSM lands on the idle slot only; the
slot carrying traffic keeps its launch template until a rollout moves traffic to the refreshed slot."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pulumi
import pytest

from infra.config import load_stack
from infra.program import preview
from infra.program.preview import PreviewResult
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


# ---- server settings belong to a slot too (release.<slot>.server) ----------------------------------------

SMALLER = {"scheduler": {"max_concurrency": 32}, "speculative": {"num_draft_tokens": 3}}


def _slot_server_yaml(stacks: Path, stack: str, slot: str) -> dict[str, Any]:
    import yaml

    from infra.config import render_server_config

    return yaml.safe_load(render_server_config(load_stack(stack, stacks).config.for_slot(slot)).to_yaml())


@pulumi.runtime.test
def test_server_settings_on_the_idle_slot_leave_the_active_slots_launch_template_unchanged(tmp_path: Path) -> None:
    before_dir, after_dir = tmp_path / "before", tmp_path / "after"
    before_dir.mkdir()
    after_dir.mkdir()
    current = load_stack("staging").config.slots.model_dump(mode="json", exclude_none=True)
    write_variant(before_dir, "staging", release={**current, "green": current["blue"]})
    write_variant(after_dir, "staging", release={**current, "green": {**current["blue"], "server": SMALLER}})
    updates = planned_updates(preview.record_in_runtime("staging", before_dir),
                              preview.record_in_runtime("staging", after_dir))
    assert key(LAUNCH_TEMPLATE, "fleet-blue-lt") not in updates  # the slot with traffic: byte for byte
    assert set(updates[key(LAUNCH_TEMPLATE, "fleet-green-lt")]) == {"userData"}
    green, blue = _slot_server_yaml(after_dir, "staging", "green"), _slot_server_yaml(after_dir, "staging", "blue")
    assert green["scheduler"]["max_concurrency"] == 32 and green["speculative"]["num_draft_tokens"] == 3
    assert blue == _slot_server_yaml(before_dir, "staging", "blue")
    # everything the slot did not set comes from the stack's sections
    assert {k: v for k, v in green["scheduler"].items() if k != "max_concurrency"} == \
        {k: v for k, v in blue["scheduler"].items() if k != "max_concurrency"}


def test_server_settings_on_the_idle_slot_leave_the_active_pods_unchanged(tmp_path: Path) -> None:
    from infra.ops.k8s_render import render_objects

    def rendered(directory: Path, green: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
        directory.mkdir()
        current = load_stack("k8s-prod").config.slots.model_dump(mode="json", exclude_none=True)
        write_variant(directory, "k8s-prod", release={**current, "green": green})
        objects = render_objects((r.type, r.inputs) for r in preview.record_stack("k8s-prod", directory).resources)
        return {(o["kind"], o["metadata"]["name"]): o for o in objects}

    green = load_stack("k8s-prod").config.slots.model_dump(mode="json", exclude_none=True)["green"]
    before = rendered(tmp_path / "before", green)
    after = rendered(tmp_path / "after", {**green, "server": SMALLER})
    assert before[("Deployment", "specdeploy-blue")] == after[("Deployment", "specdeploy-blue")]
    assert before[("Deployment", "specdeploy-green")] != after[("Deployment", "specdeploy-green")]
    blue_config = [k for k in before if k[0] == "ConfigMap" and k[1].startswith("specdeploy-blue-config")]
    assert blue_config and all(before[k] == after[k] for k in blue_config)  # same name (content hash), same data
    assert set(before) - set(after) == {k for k in before if k[1].startswith("specdeploy-green-config")}


def test_a_slots_server_settings_are_checked_and_named() -> None:
    from infra.config import ConfigError

    current = load_stack("staging").config.slots.model_dump(mode="json", exclude_none=True)
    for server, expected in (({"scheduler": {"max_concurency": 32}}, r"release\.green\.server\.scheduler: "
                                                                       r"max_concurency: Extra inputs"),
                             ({"scheduler": {"max_concurrency": 0}}, r"release\.green\.server\.scheduler: "
                                                                      r"max_concurrency")):
        with pytest.raises((ValueError, ConfigError), match=expected):
            _validate_staging({**current, "green": {**current["blue"], "server": server}})
    # staging speculates with a draft model: a slot without a draft version must speculate otherwise
    no_draft = {k: v for k, v in current["blue"].items() if k != "draft_version"}
    with pytest.raises((ValueError, ConfigError), match=r"release\.green\.draft_version is required"):
        _validate_staging({**current, "green": no_draft})
    _validate_staging({**current, "green": {**no_draft, "server": {"speculative": {"method": "ngram"}}}})


def _validate_staging(release: dict[str, Any]) -> None:
    import yaml

    from infra.config import parse_stack_mapping, project_stacks_dir

    document = yaml.safe_load((project_stacks_dir() / "Pulumi.staging.yaml").read_text())
    document["config"]["specdeploy:release"] = release
    parse_stack_mapping(document["config"], "staging")


def test_a_slot_whose_own_settings_do_not_fit_the_planned_type_is_refused() -> None:
    from infra.capacity import CapacityError, plan

    config = load_stack("staging").config
    current = config.slots.model_dump(mode="json", exclude_none=True)
    huge = {**current, "green": {**current["blue"], "server": {"scheduler": {"max_concurrency": 4096}}}}
    with_green = config.model_copy(update={"release": type(config.slots).model_validate(huge)})
    with pytest.raises(CapacityError, match=r"release\.green\.server does not fit"):
        plan(with_green)
