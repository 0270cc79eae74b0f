"""The stack-file updater changes `specdeploy:release` and nothing else, atomically."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from infra.config import ReleaseSpec, SlotSpec, load_stack, project_stacks_dir
from infra.ops.release.model import ReleaseError
from infra.ops.release.stackfile import render_release, write_release

BLUE = SlotSpec(image="img@sha256:" + "1" * 64, model_version="s3://models-bucket/m/v1")
GREEN = SlotSpec(image="img@sha256:" + "2" * 64, model_version="s3://models-bucket/m/v2")
# An aws stack must name who its alarms reach (the schema refuses one without).
ALERTS = "  specdeploy:alerting: {emails: [oncall@example.com]}\n"

COMMENTED = """\
# Staging: comments matter, reviewers read them.
config:
  aws:region: us-east-1
  specdeploy:platform: aws
  specdeploy:alerting:
    emails: [oncall@example.com]
  specdeploy:model:
    name: m
    source: s3://models-bucket/m/v1   # current weights
  # The release: edited by `specdeploy rollout`.
  specdeploy:release:
    active: blue      # who serves
    canary_weight: 0  # percent on the idle slot
    blue:
      image: img@sha256:1111111111111111111111111111111111111111111111111111111111111111
      model_version: s3://models-bucket/m/v1
    green:
      image: img@sha256:2222222222222222222222222222222222222222222222222222222222222222
      model_version: s3://models-bucket/m/v2

  # Keys below the release stay put.
  specdeploy:service:
    port: 8000
"""


def test_active_and_canary_change_in_place_keeping_comments() -> None:
    updated = render_release(COMMENTED, ReleaseSpec(active="green", canary_weight=0, blue=BLUE, green=GREEN))
    changed = [(a, b) for a, b in zip(COMMENTED.splitlines(), updated.splitlines(), strict=True) if a != b]
    assert changed == [("    active: blue      # who serves", "    active: green      # who serves")]


def test_canary_weight_is_written() -> None:
    updated = render_release(COMMENTED, ReleaseSpec(active="blue", canary_weight=10, blue=BLUE, green=GREEN))
    assert "    canary_weight: 10  # percent on the idle slot\n" in updated


def test_missing_canary_key_is_inserted() -> None:
    text = COMMENTED.replace("    canary_weight: 0  # percent on the idle slot\n", "")
    updated = render_release(text, ReleaseSpec(active="blue", canary_weight=50, blue=BLUE, green=GREEN))
    assert yaml.safe_load(updated)["config"]["specdeploy:release"]["canary_weight"] == 50
    assert "# Keys below the release stay put." in updated


def test_changed_slots_rewrite_only_the_release_block() -> None:
    green3 = SlotSpec(image="img@sha256:" + "3" * 64, model_version="s3://models-bucket/m/v3")
    updated = render_release(COMMENTED, ReleaseSpec(active="blue", blue=BLUE, green=green3))
    assert yaml.safe_load(updated)["config"]["specdeploy:release"]["green"]["model_version"].endswith("/v3")
    head, tail = COMMENTED.split("  specdeploy:release:")
    assert updated.startswith(head)
    assert updated.endswith("\n  # Keys below the release stay put.\n  specdeploy:service:\n    port: 8000\n")


def test_flow_style_release_is_rewritten_as_a_block() -> None:
    text = ("config:\n  specdeploy:platform: aws\n" + ALERTS +
            "  specdeploy:model: {name: m, source: s3://models-bucket/m/v1}\n"
            "  specdeploy:release: {active: blue, blue: {image: i, model_version: s3://models-bucket/m/v1}}\n")
    blue = SlotSpec(image="i", model_version="s3://models-bucket/m/v1")
    release = ReleaseSpec(active="blue", canary_weight=0, blue=blue, green=GREEN)
    updated = render_release(text, release)
    assert yaml.safe_load(updated)["config"]["specdeploy:release"]["green"]["image"] == GREEN.image


def test_a_stack_without_release_gets_one_appended() -> None:
    text = "config:\n  specdeploy:platform: aws\n" + ALERTS + \
        "  specdeploy:model:\n    name: m\n    source: s3://models-bucket/m/v1\n"
    updated = render_release(text, ReleaseSpec(active="blue", blue=BLUE))
    assert updated.startswith(text)
    assert yaml.safe_load(updated)["config"]["specdeploy:release"]["blue"]["image"] == BLUE.image


def test_every_repository_stack_round_trips_unchanged() -> None:
    for path in sorted(project_stacks_dir().glob("Pulumi.*.yaml")):
        stack = load_stack(path.name[len("Pulumi."):-len(".yaml")])
        text = path.read_text(encoding="utf-8")
        if stack.config.release is not None:
            assert render_release(text, stack.config.release) == text, path


def test_invalid_result_is_refused() -> None:
    with pytest.raises(ReleaseError):
        render_release("config:\n  specdeploy:platform: aws\n", ReleaseSpec(active="blue", blue=BLUE))


def test_write_is_atomic_and_keeps_the_mode(tmp_path: Path) -> None:
    path = tmp_path / "Pulumi.staging.yaml"
    path.write_text(COMMENTED, encoding="utf-8")
    os.chmod(path, 0o640)
    inode = path.stat().st_ino
    assert write_release(path, ReleaseSpec(active="green", blue=BLUE, green=GREEN))
    assert path.stat().st_ino != inode  # replaced by rename, never truncated in place
    assert path.stat().st_mode & 0o777 == 0o640
    assert list(tmp_path.iterdir()) == [path]
    assert not write_release(path, ReleaseSpec(active="green", blue=BLUE, green=GREEN))
