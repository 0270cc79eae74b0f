"""`python -m serving.weights`: the pull that instances and init containers run with the server image."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from serving.weights import push


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "serving.weights", *args], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).resolve().parents[3])


def test_pull_then_verify_then_noop(model_dir: Path, tmp_path: Path) -> None:
    uri = f"file://{tmp_path / 'store'}"
    push(model_dir, uri)
    first = _run("pull", uri, str(tmp_path / "cache" / "target"))
    assert first.returncode == 0, first.stderr
    assert "pulled and verified, 3 files" in first.stdout
    assert "already verified" in _run("pull", uri, str(tmp_path / "cache" / "target")).stdout
    assert _run("verify", str(tmp_path / "cache" / "target")).returncode == 0


def test_a_mismatch_is_one_line_naming_the_file_and_exit_2(model_dir: Path, tmp_path: Path) -> None:
    uri = f"file://{tmp_path / 'store'}"
    push(model_dir, uri)
    (tmp_path / "store" / "config.json").write_text("{}\n")
    result = _run("pull", uri, str(tmp_path / "cache" / "target"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("weights: error: config.json: size")
    assert not (tmp_path / "cache" / "target").exists()


def test_the_module_needs_nothing_from_infra() -> None:
    # The image carries serving/ only: run the module with infra made unimportable.
    code = ("import sys; sys.modules['infra'] = None; import runpy; sys.argv = ['x', '--help'];"
            "runpy.run_module('serving.weights', run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "pull" in result.stdout and "verify" in result.stdout
