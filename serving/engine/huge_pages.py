"""Whether torch's CPU allocator backs large buffers with transparent huge pages (`model.cpu_huge_pages`).

Decoding on a CPU reads every weight and the whole live KV cache each step. In 4 KiB pages that is one TLB entry
per 4 KiB, and the walks show in the step time; in 2 MiB pages it is one per 2 MiB. torch asks the kernel for
huge pages itself, for allocations of 2 MiB and more (aligned to 2 MiB, then madvise(MADV_HUGEPAGE)), when
THP_MEM_ALLOC_ENABLE=1 is in its environment when it first allocates. Most kernels run transparent huge pages
in `madvise` mode, where nothing else gets them, so without the variable the weights and KV cache stay in small
pages.

The variable has to be set before torch loads, so the server's entry point (serving/cli.py) decides, before it
imports the engine. This module imports nothing heavy for that reason. `auto`: on where the kernel gives huge
pages on request (THP mode `always` or `madvise`) and the model is not pinned to CUDA (there the weights and
cache live in GPU memory); `on`: always asked for; `off`: never. THP_MEM_ALLOC_ENABLE set by the operator wins
over all three. The start-up decisions line states the outcome with the memory actually in huge pages.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

ENV = "THP_MEM_ALLOC_ENABLE"  # read by torch's CPU allocator at its first allocation
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
SMAPS_ROLLUP = Path("/proc/self/smaps_rollup")


@dataclass(frozen=True)
class HugePagesDecision:
    on: bool
    reason: str


_taken: HugePagesDecision | None = None  # what the entry point decided for this process


def kernel_mode(path: Path = THP_MODE) -> str | None:
    """The kernel's THP mode (`always`, `madvise` or `never`: the bracketed word), None where unreadable."""
    try:
        match = re.search(r"\[(\w+)\]", path.read_text())
    except OSError:
        return None
    return match.group(1) if match else None


def _env_says(value: str) -> bool:
    """torch's reading of the variable: 1 is on; 0 is off, and so is anything else (torch warns and ignores it)."""
    return value.strip() == "1"


def decide(setting: str, device: str, environ: Mapping[str, str], mode: str | None,
           platform: str = sys.platform) -> HugePagesDecision:
    """The decision for a process about to load torch (no side effects)."""
    if ENV in environ:
        return HugePagesDecision(_env_says(environ[ENV]), f"{ENV}={environ[ENV]} in the environment")
    if setting == "off":
        return HugePagesDecision(False, "model.cpu_huge_pages is off")
    if not platform.startswith("linux"):
        return HugePagesDecision(False, f"model.cpu_huge_pages is {setting}, but huge pages are asked for on Linux "
                                        f"only ({platform})")
    if setting == "on":
        given = "the kernel gives none (THP mode never)" if mode == "never" else f"THP mode {mode or 'unknown'}"
        return HugePagesDecision(True, f"model.cpu_huge_pages is on; {given}")
    if device == "cuda":
        return HugePagesDecision(False, "auto: model.device is cuda, where the weights and KV cache are in GPU memory")
    if mode not in ("always", "madvise"):
        why = "the kernel gives none (THP mode never)" if mode == "never" else f"{THP_MODE} is unreadable"
        return HugePagesDecision(False, f"auto: {why}")
    return HugePagesDecision(True, f"auto: weights and KV cache in 2 MiB pages (THP mode {mode})")


def apply(setting: str, device: str, environ: MutableMapping[str, str] | None = None,
          mode_path: Path = THP_MODE, torch_loaded: bool | None = None) -> HugePagesDecision:
    """Decide and set the variable for torch, before torch loads; called once by the entry point (the server's,
    and the in-process benchmarks', so that their engines run as a server does)."""
    global _taken
    env = os.environ if environ is None else environ
    decision = decide(setting, device, env, kernel_mode(mode_path))
    if ENV not in env:
        if "torch" in sys.modules if torch_loaded is None else torch_loaded:  # too late: torch may have read it
            decision = HugePagesDecision(False, f"{decision.reason}, but torch was loaded before the server "
                                                f"could set {ENV}")
        else:
            env[ENV] = "1" if decision.on else "0"
    _taken = decision
    return decision


def current(environ: Mapping[str, str] | None = None) -> HugePagesDecision:
    """What holds in this process: the entry point's decision, else what the environment says (an engine built
    in-process, as the benchmarks and tests do, gets huge pages only where the variable was set for it)."""
    if _taken is not None:
        return _taken
    env = os.environ if environ is None else environ
    if ENV in env:
        return HugePagesDecision(_env_says(env[ENV]), f"{ENV}={env[ENV]} in the environment")
    return HugePagesDecision(False, f"{ENV} unset in an engine started without the server's entry point")


def huge_page_bytes(path: Path = SMAPS_ROLLUP) -> int | None:
    """This process's anonymous memory in transparent huge pages (AnonHugePages), None where unreadable."""
    try:
        match = re.search(r"^AnonHugePages:\s+(\d+) kB", path.read_text(), re.M)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def describe() -> tuple[str, str, str]:
    """The start-up line's entry: (key, value, reason with the memory in huge pages now)."""
    decision = current()
    held = huge_page_bytes()
    reason = decision.reason if held is None else f"{decision.reason}; {held / 2**20:.0f} MiB in huge pages"
    return "model.cpu_huge_pages", "on" if decision.on else "off", reason
