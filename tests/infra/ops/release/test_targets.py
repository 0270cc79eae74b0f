"""Where ARNs, alarms and endpoints come from: options, then environment, then `pulumi stack output --json`."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from infra.ops.release import targets
from infra.ops.release.model import ReleaseError
from infra.ops.release.targets import TargetOptions

OUTPUTS = {"listener_arn": "arn:listener/from-outputs", "target_group_arns": {"blue": "arn:tg/b", "green": "arn:tg/g"},
           "alarm_names": ["prod-SpecdeployHighErrorRate"]}


@pytest.fixture
def pulumi_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in `pulumi` on PATH that answers `pulumi stack output --json --stack prod` and logs its argv."""
    script = tmp_path / "bin" / "pulumi"
    script.parent.mkdir()
    script.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"open({str(tmp_path / 'argv.json')!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
        f"print(json.dumps({OUTPUTS!r}))\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin:/bin")
    return tmp_path


def test_outputs_come_from_the_pulumi_cli(pulumi_cli: Path) -> None:
    assert targets.stack_outputs("prod") == OUTPUTS
    assert json.loads((pulumi_cli / "argv.json").read_text()) == ["stack", "output", "--json", "--stack", "prod"]


def test_no_pulumi_cli_means_no_outputs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert targets.stack_outputs("prod") == {}


def test_option_beats_environment_beats_outputs() -> None:
    env = {"SPECDEPLOY_LISTENER_ARN": "arn:listener/from-env"}
    assert targets.listener_arn(TargetOptions(listener_arn="arn:listener/opt"), OUTPUTS, env) == "arn:listener/opt"
    assert targets.listener_arn(TargetOptions(), OUTPUTS, env) == "arn:listener/from-env"
    assert targets.listener_arn(TargetOptions(), OUTPUTS, {}) == "arn:listener/from-outputs"


def test_target_groups_mix_sources() -> None:
    env = {"SPECDEPLOY_GREEN_TARGET_GROUP_ARN": "arn:tg/g-env"}
    groups = targets.target_groups(TargetOptions(), OUTPUTS, env)
    assert groups == {"blue": "arn:tg/b", "green": "arn:tg/g-env"}


def test_slot_endpoints_from_the_environment() -> None:
    env = {"SPECDEPLOY_GREEN_ENDPOINT": "http://10.0.1.23:8000/, http://10.0.1.24:8000"}
    assert targets.slot_endpoints("green", TargetOptions(), env) == ["http://10.0.1.23:8000", "http://10.0.1.24:8000"]
    assert targets.slot_endpoints("blue", TargetOptions(), env) == []


@pytest.mark.parametrize("value", ["green", "purple=arn:x", "blue="])
def test_bad_target_group_option(value: str) -> None:
    with pytest.raises(ReleaseError, match="SLOT=ARN"):
        targets.parse_target_groups([value])
