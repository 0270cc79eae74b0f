"""model.cpu_huge_pages: decided before torch loads, set as THP_MEM_ALLOC_ENABLE for torch's CPU allocator, stated
on the start-up line with the memory really in huge pages; an explicit setting or the operator's variable wins."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from serving.engine import huge_pages
from serving.engine.huge_pages import ENV, apply, decide, huge_page_bytes, kernel_mode

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _no_decision_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huge_pages, "_taken", None)


@pytest.mark.parametrize("setting, device, env, mode, on, says", [
    ("auto", "auto", {}, "madvise", True, "auto: weights and KV cache in 2 MiB pages (THP mode madvise)"),
    ("auto", "cpu", {}, "always", True, "THP mode always"),
    ("auto", "auto", {}, "never", False, "the kernel gives none (THP mode never)"),
    ("auto", "auto", {}, None, False, "is unreadable"),
    ("auto", "cuda", {}, "madvise", False, "model.device is cuda"),
    ("off", "cpu", {}, "madvise", False, "model.cpu_huge_pages is off"),
    ("on", "cpu", {}, "never", True, "model.cpu_huge_pages is on; the kernel gives none (THP mode never)"),
    ("on", "cuda", {}, "madvise", True, "model.cpu_huge_pages is on; THP mode madvise"),
    # the operator's variable wins over every setting, read as torch reads it (1 is on, anything else off)
    ("off", "cpu", {ENV: "1"}, "madvise", True, f"{ENV}=1 in the environment"),
    ("auto", "cpu", {ENV: "0"}, "madvise", False, f"{ENV}=0 in the environment"),
    ("on", "cpu", {ENV: "yes"}, "madvise", False, f"{ENV}=yes in the environment"),
    ("on", "cpu", {ENV: "2"}, "madvise", False, f"{ENV}=2 in the environment"),
])
def test_the_decision_and_its_reason(setting: str, device: str, env: dict[str, str], mode: str | None, on: bool,
                                     says: str) -> None:
    decision = decide(setting, device, env, mode, platform="linux")
    assert decision.on is on and says in decision.reason


def test_huge_pages_are_asked_for_on_linux_only() -> None:
    decision = decide("on", "cpu", {}, None, platform="darwin")
    assert not decision.on and "on Linux only (darwin)" in decision.reason


def test_apply_sets_the_variable_for_torch_and_the_start_up_line_reports_it(tmp_path: Path) -> None:
    mode = tmp_path / "enabled"
    mode.write_text("always [madvise] never\n")
    env: dict[str, str] = {}
    assert apply("auto", "auto", env, mode, torch_loaded=False).on and env == {ENV: "1"}
    assert huge_pages.current().on
    key, value, why = huge_pages.describe()
    assert (key, value) == ("model.cpu_huge_pages", "on") and why.startswith("auto: weights and KV cache")
    off: dict[str, str] = {}
    assert not apply("off", "cpu", off, mode, torch_loaded=False).on and off == {ENV: "0"}


def test_the_operators_variable_is_left_as_it_is(tmp_path: Path) -> None:
    env = {ENV: "0"}
    assert not apply("on", "cpu", env, tmp_path / "absent", torch_loaded=False).on and env == {ENV: "0"}


def test_too_late_once_torch_is_loaded_and_says_so(tmp_path: Path) -> None:
    mode = tmp_path / "enabled"
    mode.write_text("[always] madvise never\n")
    env: dict[str, str] = {}
    decision = apply("auto", "cpu", env, mode, torch_loaded=True)
    assert not decision.on and "torch was loaded before the server could set" in decision.reason and env == {}


def test_an_engine_built_in_process_reports_what_its_environment_says(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert not huge_pages.current().on and "unset" in huge_pages.current().reason
    monkeypatch.setenv(ENV, "1")
    assert huge_pages.current().on


def test_kernel_mode_and_the_memory_in_huge_pages_are_read_from_proc_and_sys(tmp_path: Path) -> None:
    mode = tmp_path / "enabled"
    mode.write_text("always madvise [never]\n")
    assert kernel_mode(mode) == "never" and kernel_mode(tmp_path / "absent") is None
    rollup = tmp_path / "smaps_rollup"
    rollup.write_text("Rss:              880000 kB\nAnonHugePages:    260096 kB\nShmemPmdMapped:        0 kB\n")
    assert huge_page_bytes(rollup) == 254 * 2**20 and huge_page_bytes(tmp_path / "absent") is None


_ALLOCATE = """
import sys
from serving.engine import huge_pages
print(huge_pages.apply(sys.argv[1], "cpu").reason, file=sys.stderr)
import torch
before = huge_pages.huge_page_bytes()
cache = torch.zeros(64 * 2**20 // 4)  # a 64 MiB buffer, written through as a KV cache is
print((huge_pages.huge_page_bytes() - before) // 2**20)
"""


@pytest.mark.skipif(kernel_mode() not in ("always", "madvise"), reason="this kernel gives no huge pages on request")
def test_a_process_that_decides_before_torch_loads_gets_huge_pages_and_off_gets_none() -> None:
    """The mechanism on this machine's kernel: a fresh process applies the decision, then loads torch and writes
    a 64 MiB buffer; with `auto` most of it lands in huge pages, with `off` none does (THP mode madvise), or no
    more than the kernel gives everyone (always)."""
    env = {k: v for k, v in os.environ.items() if k != ENV}

    def huge_mib(setting: str) -> int:
        run = subprocess.run([sys.executable, "-c", _ALLOCATE, setting], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=120, check=True)
        return int(run.stdout.strip())

    on, off = huge_mib("auto"), huge_mib("off")
    assert on >= 32, (on, off)
    if kernel_mode() == "madvise":
        assert off == 0, off
