"""The stack directory is found like `pulumi` finds it: Pulumi.yaml upward from the cwd, then its stackConfigDir."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.config import REPO_ROOT, ConfigError, available_stacks, load_stack, project_dir, use_project
from infra.ops.cli.main import main

LOCAL_STACK = REPO_ROOT / "stacks" / "Pulumi.local.yaml"


@pytest.fixture(autouse=True)
def _unpinned() -> Iterator[None]:
    use_project(None)
    yield
    use_project(None)


def _project(root: Path, stack_config_dir: str | None = "stacks") -> Path:
    """A Pulumi project at ``root`` holding the repository's local stack."""
    root.mkdir(parents=True, exist_ok=True)
    setting = f"stackConfigDir: {stack_config_dir}\n" if stack_config_dir else ""
    (root / "Pulumi.yaml").write_text(f"name: specdeploy\nruntime: python\n{setting}", encoding="utf-8")
    stacks = root / stack_config_dir if stack_config_dir else root
    stacks.mkdir(parents=True, exist_ok=True)
    shutil.copy(LOCAL_STACK, stacks / "Pulumi.mine.yaml")
    return root


def test_stacks_are_found_from_a_nested_subdirectory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project = _project(tmp_path / "proj")
    nested = project / "a" / "b"
    nested.mkdir(parents=True)
    monkeypatch.chdir(nested)
    assert project_dir() == project.resolve()
    assert available_stacks() == ["mine"]
    assert load_stack("mine").path == (project / "stacks" / "Pulumi.mine.yaml").resolve()


def test_stack_config_dir_is_honoured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project = _project(tmp_path / "proj", stack_config_dir="config/envs")
    shutil.copy(LOCAL_STACK, project / "Pulumi.decoy.yaml")  # beside Pulumi.yaml, not in stackConfigDir
    monkeypatch.chdir(project)
    assert available_stacks() == ["mine"]


def test_without_stack_config_dir_the_stacks_sit_beside_pulumi_yaml(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    project = _project(tmp_path / "proj", stack_config_dir=None)
    monkeypatch.chdir(project)
    assert available_stacks() == ["mine"]


def test_outside_any_project_the_error_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"no Pulumi\.yaml in .* or any parent; .*pass --project DIR"):
        project_dir()
    assert main(["config", "validate"]) == 2
    assert "no Pulumi.yaml in" in capsys.readouterr().err


def test_project_option_overrides_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    project = _project(tmp_path / "proj")
    monkeypatch.chdir(REPO_ROOT)  # inside another project: --project still wins
    assert main(["--project", str(project), "config", "validate"]) == 0
    assert capsys.readouterr().out.split() == ["ok", "mine", "(local,", "Pulumi.mine.yaml)"]


def test_project_option_without_pulumi_yaml_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--project", str(tmp_path), "config", "validate"]) == 2
    assert f"--project {tmp_path}: no Pulumi.yaml there" in capsys.readouterr().err


def test_report_dir_defaults_into_the_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from infra.validation.runner import default_report_dir

    project = _project(tmp_path / "proj")
    monkeypatch.chdir(project / "stacks")
    report = default_report_dir("mine", "quick")
    assert report.parent == project.resolve() / "reports" and report.name.startswith("mine-quick-")
