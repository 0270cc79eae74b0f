"""`specdeploy preview --against REF` names the changes that reach the slots carrying traffic without a canary
(issue 13: a change lands on the idle slot and reaches traffic only through a rollout)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.config import load_stack
from infra.ops.cli.main import main
from infra.ops.live_changes import live_changes
from tests.infra.conftest import write_variant


def _git(directory: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=directory, check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@e", "PATH": "/usr/bin:/bin"})


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A git repository holding stack staging with both slots defined (blue active, green idle), committed."""
    current = load_stack("staging").config.slots.model_dump(mode="json", exclude_none=True)
    write_variant(tmp_path, "staging", release={**current, "green": current["blue"]})
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "deployed")
    return tmp_path


def _edit(repo: Path, **sections: Any) -> None:
    path = repo / "Pulumi.staging.yaml"
    document = yaml.safe_load(path.read_text())
    for section, value in sections.items():
        document["config"][f"specdeploy:{section}"] = {**document["config"][f"specdeploy:{section}"], **value}
    path.write_text(yaml.safe_dump(document, sort_keys=False))


def _preview(repo: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["preview", "--stack", "staging", "--stacks-dir", str(repo), "--against", "HEAD"]) == 0
    return capsys.readouterr().out


def test_an_edit_of_the_stacks_own_sections_is_flagged_as_reaching_traffic(
        repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "nothing changes on the slots carrying traffic" in _preview(repo, capsys)
    _edit(repo, scheduler={"max_concurrency": 24})
    out = _preview(repo, capsys)
    assert "WARNING against HEAD" in out
    assert "blue: server.scheduler.max_concurrency: 32 -> 24" in out
    assert "green:" not in out.split("WARNING", 1)[1]  # idle: not reported


def test_the_same_change_on_the_idle_slot_is_not(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    release = yaml.safe_load((repo / "Pulumi.staging.yaml").read_text())["config"]["specdeploy:release"]
    _edit(repo, release={"green": {**release["green"], "server": {"scheduler": {"max_concurrency": 24}},
                                   "image": release["green"]["image"].replace("sha256:", "sha256:0")[:-1]}})
    assert "nothing changes on the slots carrying traffic" in _preview(repo, capsys)


def test_a_canary_slot_carries_traffic_too() -> None:
    config = load_stack("k8s-prod").config  # blue active, 10 % on green
    slots = config.slots.model_dump(mode="json", exclude_none=True)
    slots["green"]["server"] = {"speculative": {"enabled": False}}
    after = config.model_copy(update={"release": type(config.slots).model_validate(slots)})
    changes = live_changes(config, after)
    assert [(c.slot, c.key, c.before, c.after) for c in changes] == [
        ("green", "server.speculative.draft_model", "/data/models/draft", None),  # no draft loaded without it
        ("green", "server.speculative.enabled", True, False),
    ]


def test_an_unknown_revision_is_a_clear_error(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["preview", "--stack", "staging", "--stacks-dir", str(repo), "--against", "no-such-ref"]) != 0
    assert "--against no-such-ref: cannot read Pulumi.staging.yaml at that revision" in capsys.readouterr().err
