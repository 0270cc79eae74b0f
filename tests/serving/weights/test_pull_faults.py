"""Pulls that overlap or die: shared caches (two pods on one volume), and a pull killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serving.weights import pull, push, verify_dir

# Pull into CACHE/target from STORE; wait for GO to exist first so that both processes start together.
_PULL_SCRIPT = """
import json, os, sys, time
from pathlib import Path
from serving.weights import pull
store, target, go = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
while not go.exists():
    time.sleep(0.001)
result = pull(store, target)
print(json.dumps({"fetched": result.fetched}))
"""


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if ".partial-" in p.name or ".old-" in p.name)


def test_a_pull_removes_staging_left_by_a_killed_pull(model_dir: Path, tmp_path: Path) -> None:
    uri = f"file://{tmp_path / 'store'}"
    push(model_dir, uri)
    cache = tmp_path / "cache"
    for leftover in (".target.partial-x1y2", ".target.old-z3"):
        (cache / leftover / "version").mkdir(parents=True)
        (cache / leftover / "version" / "model.safetensors").write_bytes(b"\0" * 4096)
    unrelated = cache / ".other.partial-keep"  # another model's staging: not ours to remove
    unrelated.mkdir()
    result = pull(uri, cache / "target")
    assert result.fetched
    verify_dir(cache / "target")
    assert _leftovers(cache) == [".other.partial-keep"]


def test_two_concurrent_pulls_into_one_cache_fetch_once_and_both_succeed(model_dir: Path, tmp_path: Path) -> None:
    uri = f"file://{tmp_path / 'store'}"
    push(model_dir, uri)
    cache, go = tmp_path / "cache", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    procs = [
        subprocess.Popen([sys.executable, "-c", _PULL_SCRIPT, uri, str(cache / "target"), str(go)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    time.sleep(1.5)  # both interpreters are up and polling for GO
    go.touch()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1])["fetched"])
    # Serialised by the lock: one downloads, the other finds the verified version and reads nothing.
    assert sorted(results) == [False, True]
    verify_dir(cache / "target")
    assert _leftovers(cache) == []


@pytest.mark.slow
def test_a_pull_killed_with_sigkill_is_followed_by_a_clean_pull(tmp_path: Path) -> None:
    source = tmp_path / "big"
    source.mkdir()
    (source / "config.json").write_text('{"hidden_size": 8}\n')
    with (source / "model.safetensors").open("wb") as handle:  # large enough to be caught mid-pull
        handle.truncate(384 * 1024 * 1024)
    uri = f"file://{tmp_path / 'store'}"
    push(source, uri)
    cache, go = tmp_path / "cache", tmp_path / "go"
    go.touch()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    proc = subprocess.Popen([sys.executable, "-c", _PULL_SCRIPT, uri, str(cache / "target"), str(go)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (cache.is_dir() and _leftovers(cache)):
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert _leftovers(cache), "the pull finished before it could be killed; make the file larger"
    assert not (cache / "target").exists()  # nothing half-written in place of the version

    result = pull(uri, cache / "target")  # the lock died with its holder: no wait, no stale staging
    assert result.fetched
    verify_dir(cache / "target")
    assert _leftovers(cache) == []
