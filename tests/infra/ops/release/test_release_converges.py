"""Issue 13: a full rollout 10→50→100 and a rollback against loopback moto, each followed by a simulated
`pulumi up` of the stack file (with and without --refresh): no traffic moves, no paging alarm watches the
idle slot, and once recorded the stack file, Pulumi's state and the listener agree."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from infra.config import StackFile, load_stack
from infra.ops.cli.main import main
from infra.ops.release import validation
from infra.ops.release.validation import ValidationOutcome
from infra.program.preview import PreviewResult, record_stack
from tests.infra.pulumi_up import ALARM, LISTENER, key, planned_updates

from .conftest import AwsRelease, SlotServer

FAST = ["--observe", "0.3s", "--poll", "0.1s"]


@pytest.fixture
def passing_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    def passed(stack: StackFile, endpoint: str, report_dir: Path) -> ValidationOutcome:
        return ValidationOutcome(True, "quick profile passed")

    monkeypatch.setattr(validation, "launch_validator", lambda hosts: passed)


def _cli(command: list[str], aws: AwsRelease, stacks: Path, *extra: str) -> int:
    return main([*command, "--stack", "prod", "--stacks-dir", str(stacks), "--state-dir",
                 str(stacks.parent / "state"), *aws.cli_args(), *extra])


def _listener(result: PreviewResult) -> Any:
    (listener,) = [r for r in result.of_type(LISTENER) if r.inputs["defaultActions"][0]["type"] == "forward"
                   and r.inputs["port"] in (80, 443)]
    return listener


def _slot_of_arn(arn: str) -> str:
    return arn.rsplit("-", 1)[-1]  # the mocks name target groups lb-blue / lb-green


def _program_weights(default_actions: list[dict[str, Any]]) -> dict[str, int]:
    groups = default_actions[0]["forward"]["targetGroups"]
    return {_slot_of_arn(g["arn"]): int(g["weight"]) for g in groups}


def _refreshed(aws: AwsRelease, state: PreviewResult) -> dict[str, dict[str, Any]]:
    """What `pulumi refresh` reads back: the listener's live weights and every alarm's live actions flag."""
    import boto3

    listener = _listener(state)
    actions = copy.deepcopy(listener.inputs["defaultActions"])
    live = aws.weights()
    for group in actions[0]["forward"]["targetGroups"]:
        group["weight"] = live[_slot_of_arn(group["arn"])]
    refreshed = {key(LISTENER, listener.name): {"defaultActions": actions}}
    alarms = boto3.client("cloudwatch").describe_alarms(AlarmNames=aws.alarm_names)["MetricAlarms"]
    enabled = {a["AlarmName"]: bool(a["ActionsEnabled"]) for a in alarms}
    for alarm in state.of_type(ALARM):
        refreshed[key(ALARM, alarm.name)] = {"actionsEnabled": enabled[alarm.inputs["name"]]}
    return refreshed


def _pulumi_up(aws: AwsRelease, state: PreviewResult, program: PreviewResult, refresh: bool) -> dict[str, Any]:
    """Apply what the update would change on the listener and the alarms to moto, as the engine would."""
    import boto3

    updates = planned_updates(state, program, _refreshed(aws, state) if refresh else None)
    listener = _listener(program)
    if "defaultActions" in updates.get(key(LISTENER, listener.name), {}):
        aws.set_weights(_program_weights(updates[key(LISTENER, listener.name)]["defaultActions"]))
    cloudwatch = boto3.client("cloudwatch")
    for alarm in program.of_type(ALARM):
        change = updates.get(key(ALARM, alarm.name), {})
        if "actionsEnabled" in change:
            toggle = cloudwatch.enable_alarm_actions if change["actionsEnabled"] else cloudwatch.disable_alarm_actions
            toggle(AlarmNames=[alarm.inputs["name"]])
    return {k: v for k, v in updates.items() if k.startswith((LISTENER, ALARM))}


@pytest.mark.slow
def test_rollout_and_rollback_survive_a_later_pulumi_up(
        aws_release: AwsRelease, prod_copy: Path, slot_server: SlotServer, passing_validation: None) -> None:
    stack_file = prod_copy / "Pulumi.prod.yaml"
    deployed = record_stack("prod", prod_copy)  # the last `pulumi up` before the release: blue 100 %
    assert _program_weights(_listener(deployed).inputs["defaultActions"]) == {"blue": 100, "green": 0}

    # A full rollout 10 → 50 → 100.
    assert _cli(["rollout", "--to", "green", "--slot-endpoint", slot_server.url], aws_release, prod_copy,
                *FAST) == 0
    assert aws_release.weights() == {"blue": 0, "green": 100}
    assert aws_release.paging() == {"blue": False, "green": True}
    assert load_stack("prod", prod_copy).config.slots.active == "green"
    after_rollout = record_stack("prod", prod_copy)
    assert _program_weights(_listener(after_rollout).inputs["defaultActions"]) == aws_release.weights()
    for refresh in (False, True):
        touched = _pulumi_up(aws_release, deployed, after_rollout, refresh)
        assert touched == {}, f"pulumi up (refresh={refresh}) would change {touched}"
        assert aws_release.weights() == {"blue": 0, "green": 100}
        assert aws_release.paging() == {"blue": False, "green": True}

    # A rollback: the listener (and paging) only; the stack file still says green until recorded.
    before = stack_file.read_text()
    assert _cli(["rollback"], aws_release, prod_copy) == 0
    assert aws_release.weights() == {"blue": 100, "green": 0}
    assert aws_release.paging() == {"blue": True, "green": False}
    assert stack_file.read_text() == before
    unrecorded = record_stack("prod", prod_copy)  # a `pulumi up` of the stale stack file
    for refresh in (False, True):
        touched = _pulumi_up(aws_release, after_rollout, unrecorded, refresh)
        assert touched == {}, f"pulumi up (refresh={refresh}) would change {touched}"
        assert aws_release.weights() == {"blue": 100, "green": 0}  # no traffic moved back to green
        assert aws_release.paging() == {"blue": True, "green": False}  # nothing pages for the idle slot

    # Recorded: the stack file, Pulumi's (refreshed) state and the listener say the same.
    assert _cli(["release", "record", "--check"], aws_release, prod_copy) == 1
    assert _cli(["release", "record"], aws_release, prod_copy) == 0
    assert _cli(["release", "record", "--check"], aws_release, prod_copy) == 0
    recorded = record_stack("prod", prod_copy)
    assert _program_weights(_listener(recorded).inputs["defaultActions"]) == aws_release.weights()
    refreshed_state = _refreshed(aws_release, unrecorded)[key(LISTENER, _listener(unrecorded).name)]
    assert _program_weights(refreshed_state["defaultActions"]) == aws_release.weights()
    enabled = {a.inputs["name"] for a in recorded.of_type(ALARM) if a.inputs["actionsEnabled"]}
    assert enabled and all("-blue-" in name for name in enabled)  # a fresh stack would page for blue only
    for refresh in (False, True):
        assert _pulumi_up(aws_release, unrecorded, recorded, refresh) == {}
        assert aws_release.weights() == {"blue": 100, "green": 0}
