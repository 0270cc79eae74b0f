"""`specdeploy rollout` / `rollback` end to end against a loopback moto_server (ALB + CloudWatch)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from infra.config import StackFile, load_stack
from infra.ops.cli.main import main
from infra.ops.release import validation
from infra.ops.release.guard import ShiftGuard
from infra.ops.release.stackfile import write_release
from infra.ops.release.validation import ValidationOutcome

from .conftest import ALARM_PREFIX, AwsRelease, SlotServer

FAST = ["--observe", "0.3s", "--poll", "0.1s"]


@pytest.fixture
def validated(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace the launch validation with a recorder that passes; returns the endpoints it was run against."""
    seen: list[str] = []

    def fake(stack: StackFile, endpoint: str, report_dir: Path) -> ValidationOutcome:
        seen.append(endpoint)
        return ValidationOutcome(True, "12 checks passed")

    monkeypatch.setattr(validation, "launch_validator", lambda hosts: fake)
    return seen


def rollout(aws: AwsRelease, stacks: Path, slot: SlotServer, *extra: str) -> int:
    return main(["rollout", "--stack", "prod", "--to", "green", "--stacks-dir", str(stacks),
                 "--state-dir", str(stacks.parent / "state"), "--slot-endpoint", slot.url,
                 *aws.cli_args(), *FAST, *extra])


def rollback(aws: AwsRelease, stacks: Path, *extra: str) -> int:
    return main(["rollback", "--stack", "prod", "--stacks-dir", str(stacks), "--state-dir",
                 str(stacks.parent / "state"), *aws.cli_args(), *extra])


def record(aws: AwsRelease, stacks: Path, *extra: str) -> int:
    return main(["release", "record", "--stack", "prod", "--stacks-dir", str(stacks), "--state-dir",
                 str(stacks.parent / "state"), *aws.cli_args(), *extra])


def events(stacks: Path) -> list[dict[str, Any]]:
    lines = (stacks.parent / "state" / "prod.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def release_of(stacks: Path) -> tuple[str, int]:
    release = load_stack("prod", stacks).config.slots
    return release.active, release.canary_weight


def only_release_lines_changed(before: str, after: str) -> list[tuple[str, str]]:
    old, new = before.splitlines(), after.splitlines()
    assert len(old) == len(new)
    return [(a, b) for a, b in zip(old, new, strict=True) if a != b]


def when_weight(aws: AwsRelease, percent: int, action: Callable[[], None]) -> threading.Thread:
    """Run ``action`` from another thread within the observe window of the step sending ``percent`` to green."""
    def watch() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if aws.weights()["green"] == percent:
                time.sleep(0.3)  # after the window's baseline scrape
                action()
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_full_rollout_shifts_10_50_100_and_updates_the_stack_file(
        aws_release: AwsRelease, prod_copy: Path, slot_server: SlotServer, validated: list[str],
        capsys: pytest.CaptureFixture[str]) -> None:
    before = (prod_copy / "Pulumi.prod.yaml").read_text()
    assert rollout(aws_release, prod_copy, slot_server) == 0
    assert aws_release.weights() == {"blue": 0, "green": 100}
    assert aws_release.count("ModifyListener") == 3
    shifts = [e["weight"] for e in events(prod_copy) if e["event"] == "shift"]
    assert shifts == [10, 50, 100]
    assert validated == [slot_server.url]
    assert release_of(prod_copy) == ("green", 0)
    assert only_release_lines_changed(before, (prod_copy / "Pulumi.prod.yaml").read_text()) == [
        ("    active: blue", "    active: green")]
    out = capsys.readouterr().out
    assert "git add" in out and "Pulumi.prod.yaml" in out
    # Every step is logged as one JSON line.
    kinds = [e["event"] for e in events(prod_copy)]
    assert kinds[0] == "alarms" and "start" in kinds and kinds[-2:] == ["done", "lock_released"]
    assert kinds.index("lock_acquired") < kinds.index("start")  # the shared lock brackets the release
    assert kinds.count("step_ok") == 3
    checks = [e for e in events(prod_copy) if e["event"] == "guard_check"]
    assert checks and all(c["ok"] for c in checks)
    assert all(e["stack"] == "prod" and isinstance(e["ts"], float) for e in events(prod_copy))


def test_alarm_mid_rollout_rolls_back_to_the_old_slot(
        aws_release: AwsRelease, prod_copy: Path, slot_server: SlotServer, validated: list[str],
        capsys: pytest.CaptureFixture[str]) -> None:
    before = (prod_copy / "Pulumi.prod.yaml").read_text()
    watcher = when_weight(aws_release, 50, lambda: aws_release.set_alarm("SpecdeployHighErrorRate"))
    assert rollout(aws_release, prod_copy, slot_server, "--observe", "1.2s") == 1
    watcher.join()
    assert aws_release.weights() == {"blue": 100, "green": 0}
    assert [e["weight"] for e in events(prod_copy) if e["event"] == "shift"] == [10, 50]
    rolled = [e for e in events(prod_copy) if e["event"] == "rollback"]
    assert len(rolled) == 1 and rolled[0]["automatic"] and rolled[0]["at_weight"] == 50
    assert f"{ALARM_PREFIX}green-SpecdeployHighErrorRate" in rolled[0]["reason"]
    out = capsys.readouterr().out
    assert "rolled back" in out and "SpecdeployHighErrorRate is ALARM" in out
    assert release_of(prod_copy) == ("blue", 0)
    assert (prod_copy / "Pulumi.prod.yaml").read_text() == before


def test_error_rate_on_the_new_slot_rolls_back_before_any_alarm(
        aws_release: AwsRelease, prod_copy: Path, slot_server: SlotServer, validated: list[str],
        capsys: pytest.CaptureFixture[str]) -> None:
    when_weight(aws_release, 10, lambda: slot_server.serve(100, errors=30))
    assert rollout(aws_release, prod_copy, slot_server, "--observe", "1.2s") == 1
    assert aws_release.weights() == {"blue": 100, "green": 0}
    assert "green error rate" in capsys.readouterr().out
    assert release_of(prod_copy) == ("blue", 0)


def test_slow_new_slot_rolls_back_on_p99(aws_release: AwsRelease, prod_copy: Path, slot_server: SlotServer,
                                         validated: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    when_weight(aws_release, 10, lambda: slot_server.serve(200, latency_s=60.0))
    assert rollout(aws_release, prod_copy, slot_server, "--observe", "1.2s") == 1
    assert "P99 latency" in capsys.readouterr().out
    assert aws_release.weights() == {"blue": 100, "green": 0}


def test_failed_validation_moves_no_traffic(aws_release: AwsRelease, prod_copy: Path, slot_server: SlotServer,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(validation, "launch_validator", lambda hosts: lambda *a: ValidationOutcome(
        False, "1 check(s) failed: test_long_input_works", "r/report.html"))
    assert rollout(aws_release, prod_copy, slot_server) == 1
    assert aws_release.count("ModifyListener") == 0
    assert "launch validation failed on green: 1 check(s) failed: test_long_input_works" in capsys.readouterr().out
    assert release_of(prod_copy) == ("blue", 0)


def test_unready_slot_is_refused_before_validation(aws_release: AwsRelease, prod_copy: Path,
                                                   slot_server: SlotServer, validated: list[str]) -> None:
    slot_server.ready = False
    assert rollout(aws_release, prod_copy, slot_server) == 1
    assert validated == [] and aws_release.count("ModifyListener") == 0


def test_alarm_already_firing_refuses_to_start(aws_release: AwsRelease, prod_copy: Path, slot_server: SlotServer,
                                               validated: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    aws_release.set_alarm("SpecdeployQueueBacklog")
    assert rollout(aws_release, prod_copy, slot_server) == 1
    assert aws_release.count("ModifyListener") == 0
    assert "already firing" in capsys.readouterr().out


def test_rollback_flips_all_traffic_in_one_api_call(aws_release: AwsRelease, prod_copy: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    released = load_stack("prod", prod_copy).config.slots.model_copy(update={"active": "green"})
    write_release(prod_copy / "Pulumi.prod.yaml", released)  # as a finished rollout to green leaves it
    aws_release.set_weights({"blue": 0, "green": 100})
    aws_release.calls.clear()
    before = (prod_copy / "Pulumi.prod.yaml").read_text()
    assert rollback(aws_release, prod_copy) == 0
    assert aws_release.count("ModifyListener") == 1
    mutating = [c for c in aws_release.calls if not c.split(".")[-1].startswith("Describe")
                and not c.startswith("s3.")]  # S3: the release lock and audit trail
    # The listener, then paging follows the traffic: nothing else (no pulumi up, no stack file).
    assert mutating == ["elastic-load-balancing-v2.ModifyListener", "cloudwatch.EnableAlarmActions",
                        "cloudwatch.DisableAlarmActions"]
    assert aws_release.weights() == {"blue": 100, "green": 0}
    assert aws_release.paging() == {"blue": True, "green": False}
    assert (prod_copy / "Pulumi.prod.yaml").read_text() == before  # recording is its own step
    out = capsys.readouterr().out
    assert "specdeploy release record --stack prod" in out and "pulumi up" not in out
    assert record(aws_release, prod_copy, "--check") == 1
    assert record(aws_release, prod_copy) == 0
    assert release_of(prod_copy) == ("blue", 0)
    out = capsys.readouterr().out
    assert "-    active: green" in out and "+    active: blue" in out and "git add" in out
    assert record(aws_release, prod_copy, "--check") == 0


def test_interrupted_rollout_resumes_from_its_last_step(
        aws_release: AwsRelease, prod_copy: Path, slot_server: SlotServer, validated: list[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    interrupt_at_50(monkeypatch)
    assert rollout(aws_release, prod_copy, slot_server) == 130
    assert aws_release.weights() == {"blue": 50, "green": 50}
    assert release_of(prod_copy) == ("blue", 0)
    monkeypatch.undo()
    monkeypatch.setattr(validation, "launch_validator", lambda hosts: lambda *a: pytest.fail("validated twice"))
    assert rollout(aws_release, prod_copy, slot_server) == 2  # refuses to start over the interrupted one
    aws_release.calls.clear()
    assert rollout(aws_release, prod_copy, slot_server, "--resume") == 0
    assert aws_release.count("ModifyListener") == 2  # 50 (observed again) and 100
    assert aws_release.weights() == {"blue": 0, "green": 100}
    assert release_of(prod_copy) == ("green", 0)


def test_interrupted_rollout_can_be_rolled_back(
        aws_release: AwsRelease, prod_copy: Path, slot_server: SlotServer, validated: list[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    interrupt_at_50(monkeypatch)
    assert rollout(aws_release, prod_copy, slot_server) == 130
    aws_release.calls.clear()
    assert rollback(aws_release, prod_copy) == 0
    assert aws_release.count("ModifyListener") == 1
    assert aws_release.weights() == {"blue": 100, "green": 0}
    assert release_of(prod_copy) == ("blue", 0)
    state = json.loads((prod_copy.parent / "state" / "prod.state.json").read_text())
    assert state["phase"] == "rolled_back"
    assert rollout(aws_release, prod_copy, slot_server, "--resume") == 2  # nothing left to resume


def test_rollout_held_at_a_canary_records_the_weight(aws_release: AwsRelease, prod_copy: Path,
                                                     slot_server: SlotServer, validated: list[str]) -> None:
    assert rollout(aws_release, prod_copy, slot_server, "--steps", "10") == 0
    assert aws_release.weights() == {"blue": 90, "green": 10}
    assert release_of(prod_copy) == ("blue", 10)
    assert aws_release.paging() == {"blue": True, "green": True}  # both slots serve: both page
    assert rollback(aws_release, prod_copy, "--record") == 0  # a committed canary is removed
    assert aws_release.weights() == {"blue": 100, "green": 0}
    assert release_of(prod_copy) == ("blue", 0)
    assert aws_release.paging() == {"blue": True, "green": False}


def interrupt_at_50(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while the 50 % step is being observed."""
    original = ShiftGuard.observe

    def observe(self: ShiftGuard, slot: str, weight: int, seconds: float) -> str | None:
        if weight == 50:
            raise KeyboardInterrupt
        return original(self, slot, weight, seconds)

    monkeypatch.setattr(ShiftGuard, "observe", observe)


def test_arns_and_alarm_names_come_from_the_stack_outputs(
        aws_release: AwsRelease, prod_copy: Path, slot_server: SlotServer, validated: list[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from infra.ops.release import targets

    outputs = {"listener_arn": aws_release.listener_arn, "target_group_arns": aws_release.target_groups,
               "alarm_names": aws_release.alarm_names}
    monkeypatch.setattr(targets, "stack_outputs", lambda stack: outputs)  # as `pulumi stack output --json` says
    assert main(["rollout", "--stack", "prod", "--to", "green", "--stacks-dir", str(prod_copy), "--state-dir",
                 str(prod_copy.parent / "state"), "--slot-endpoint", slot_server.url, *FAST]) == 0
    assert aws_release.weights() == {"blue": 0, "green": 100}


def test_arns_come_from_the_environment(aws_release: AwsRelease, prod_copy: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEPLOY_LISTENER_ARN", aws_release.listener_arn)
    for slot, arn in aws_release.target_groups.items():
        monkeypatch.setenv(f"SPECDEPLOY_{slot.upper()}_TARGET_GROUP_ARN", arn)
    assert main(["rollback", "--stack", "prod", "--to", "green", "--stacks-dir", str(prod_copy),
                 "--state-dir", str(prod_copy.parent / "state"), "--record"]) == 0
    assert aws_release.weights() == {"blue": 0, "green": 100}
    assert release_of(prod_copy) == ("green", 0)


def test_missing_listener_is_a_one_line_error(aws_release: AwsRelease, prod_copy: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rollback", "--stack", "prod", "--stacks-dir", str(prod_copy)]) == 2
    assert "pass --listener-arn or set SPECDEPLOY_LISTENER_ARN" in capsys.readouterr().err


def test_rollback_never_runs_pulumi_up_even_when_a_cli_exists(
        aws_release: AwsRelease, prod_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from pulumi import automation

    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/pulumi" if name == "pulumi" else real_which(name))
    monkeypatch.setattr(automation, "select_stack", lambda **kwargs: pytest.fail("rollback ran pulumi up"))
    from infra.ops.release import targets

    monkeypatch.setattr(targets, "stack_outputs", lambda stack: {})
    assert main(["rollback", "--stack", "prod", "--to", "green", "--stacks-dir", str(prod_copy), "--state-dir",
                 str(prod_copy.parent / "state"), *aws_release.cli_args()]) == 0
    assert aws_release.weights() == {"blue": 0, "green": 100}


def test_launch_validator_runs_the_quick_profile_against_the_slot(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    import infra.validation
    from infra.validation.runner import ValidationResult

    calls: list[dict[str, Any]] = []

    def fake_run(endpoint: str, stack: str, **kwargs: Any) -> ValidationResult:
        calls.append({"endpoint": endpoint, "stack": stack, **kwargs})
        checks = [{"nodeid": "tests/launch/test_functional.py::test_ready", "outcome": "failed"}]
        return ValidationResult(False, 1, tmp_path, {"passed": False, "checks": checks})

    monkeypatch.setattr(infra.validation, "run_validation", fake_run)
    outcome = validation.launch_validator(["ssh://ubuntu@10.0.1.23"])(load_stack("prod"), "http://10.0.1.23:8000",
                                                                     tmp_path)
    assert calls == [{"endpoint": "http://10.0.1.23:8000", "stack": "prod", "profile": "quick",
                      "report_dir": tmp_path, "hosts": ["ssh://ubuntu@10.0.1.23"]}]
    assert not outcome.passed and "test_ready" in outcome.summary


def test_target_group_without_healthy_targets_is_not_ready(aws_release: AwsRelease) -> None:
    import boto3

    from infra.ops.release.aws import AlbRouter

    elbv2 = boto3.client("elbv2")
    vpc = elbv2.describe_target_groups(TargetGroupArns=[aws_release.target_groups["green"]])["TargetGroups"][0]["VpcId"]
    empty = elbv2.create_target_group(Name="specdeploy-prod-empty", Protocol="HTTP", Port=8000, VpcId=vpc,
                                      TargetType="instance")["TargetGroups"][0]["TargetGroupArn"]
    try:
        router = AlbRouter(elbv2, aws_release.listener_arn, {"blue": aws_release.target_groups["blue"], "green": empty})
        status = router.slot_status("green")
        assert not status.ready and "no targets registered" in status.detail
        assert router.slot_status("blue").ready
    finally:
        elbv2.delete_target_group(TargetGroupArn=empty)


def test_interrupt_says_how_to_continue(aws_release: AwsRelease, prod_copy: Path, slot_server: SlotServer,
                                        validated: list[str], monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    interrupt_at_50(monkeypatch)
    assert rollout(aws_release, prod_copy, slot_server) == 130
    out = capsys.readouterr().out
    assert "--resume" in out and "specdeploy rollback --stack prod" in out
    assert events(prod_copy)[-1]["event"] == "interrupted"


def test_aws_errors_are_one_line(aws_release: AwsRelease, prod_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rollback", "--stack", "prod", "--stacks-dir", str(prod_copy), "--listener-arn",
                 aws_release.listener_arn.replace("listener/app/", "listener/app/x"),
                 "--target-group", f"blue={aws_release.target_groups['blue']}",
                 "--target-group", f"green={aws_release.target_groups['green']}"]) == 2
    assert "specdeploy: error: AWS API:" in capsys.readouterr().err


def test_rollout_to_an_empty_slot_says_fill_it_first(
        aws_release: AwsRelease, tmp_path: Path, slot_server: SlotServer, capsys: pytest.CaptureFixture[str]) -> None:
    stacks = tmp_path / "stacks"
    stacks.mkdir()
    (stacks / "Pulumi.prod.yaml").write_text((load_stack("prod").path).read_text())  # blue only
    assert rollout(aws_release, stacks, slot_server) == 2
    assert "release.green is not defined" in capsys.readouterr().err
    assert aws_release.count("ModifyListener") == 0


def test_one_release_operation_per_stack_at_a_time(aws_release: AwsRelease, prod_copy: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from infra.ops.release.state import StateStore

    with StateStore(prod_copy.parent / "state", "prod").exclusive():  # a rollout running in another terminal
        assert rollback(aws_release, prod_copy) == 2
    assert "another rollout or rollback of this stack is running" in capsys.readouterr().err
    assert aws_release.count("ModifyListener") == 0
