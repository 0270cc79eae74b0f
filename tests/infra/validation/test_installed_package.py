"""`specdeploy` works from a wheel installed outside the repository: stacks come from the Pulumi
project the command runs in, and the launch suite ships inside the package."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from infra.config import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

_NOT_SOURCES = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")


def _run(command: list[str], cwd: Path) -> str:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _build_wheel(tmp_path: Path) -> Path:
    """The wheel of a copy of the sources, so the build leaves nothing in the checkout."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    for package in ("infra", "serving"):
        shutil.copytree(REPO_ROOT / package, source / package, ignore=_NOT_SOURCES)
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", str(wheels), str(source)], cwd=tmp_path)
    (wheel,) = wheels.glob("specdeploy-*.whl")
    return wheel


def _venv_with(wheel: Path, tmp_path: Path) -> Path:
    """A fresh venv holding the wheel; its dependencies resolve from this interpreter's site-packages
    (a .pth line, read after the venv's own packages), so no network is needed."""
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)], cwd=tmp_path)
    venv_site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          cwd=tmp_path).strip())
    (venv_site / "dependencies-from-dev-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def test_installed_wheel_validates_stacks_of_the_project_it_runs_in(tmp_path: Path) -> None:
    venv = _venv_with(_build_wheel(tmp_path), tmp_path)
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(REPO_ROOT / "Pulumi.yaml", project / "Pulumi.yaml")
    shutil.copytree(REPO_ROOT / "stacks", project / "stacks")
    nested = project / "notes"
    nested.mkdir()
    specdeploy = str(venv / "bin" / "specdeploy")

    imported = _run([str(venv / "bin" / "python"), "-c", "import infra; print(infra.__file__)"], cwd=nested)
    assert Path(imported.strip()).is_relative_to(venv), f"imported {imported.strip()}, not the installed wheel"

    validated = _run([specdeploy, "config", "validate"], cwd=nested)
    stacks = sorted(p.name[len("Pulumi."):-len(".yaml")] for p in (REPO_ROOT / "stacks").glob("Pulumi.*.yaml"))
    assert [line.split()[1] for line in validated.splitlines()] == stacks
    assert "Functional, host, performance" in _run([specdeploy, "validate", "--help"], cwd=nested)

    # The suite `specdeploy validate` runs is inside the installed package, conftest included.
    suite = Path(imported.strip()).parent / "validation" / "launch"
    collected = _run([str(venv / "bin" / "python"), "-m", "pytest", str(suite), "--collect-only", "-q",
                      "-p", "no:cacheprovider", "--endpoint", "http://127.0.0.1:9", "--stack", "local"],
                     cwd=project)
    assert "test_functional.py::" in collected and "test_observability.py::" in collected
