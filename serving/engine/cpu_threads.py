"""How many threads torch's CPU kernels use (`model.num_threads`), decided once at start-up.

torch's default is one intra-op thread per core. For the small matmuls of decoding that is rarely best: the
threads wait for each other at every op, and in a server the HTTP front end, tokenizer and detokenizer need a
core of their own, which torch's threads then take from them in turns. `auto` therefore keeps one core for
everything that is not the forward (engine threads <= usable cores - 1, at least one), and where that leaves a
choice it measures: the target's one-token step and a 16-token step (a batch of decodes or a verify) at every
candidate count, interleaved, and takes the count whose worse shape is nearest its own best.

An explicit setting always wins: an integer in the config, else OMP_NUM_THREADS in the environment (what the
operator set for the process). On CUDA the host threads only launch kernels and are left alone.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from serving.engine.model import Transformer
from serving.engine.timing import forward_seconds, interleaved_medians

log = logging.getLogger(__name__)

_ROUNDS, _MIN_ROUNDS, _BUDGET_S = 5, 2, 4.0  # interleaved rounds of the measurement, cut short on large models
_WIDE_STEP = 16  # tokens of the batched shape timed beside the one-token step


@dataclass(frozen=True)
class ThreadsDecision:
    threads: int | None  # None: left as torch had it (CUDA)
    reason: str
    step_ms: dict[int, tuple[float, float]] | None = None  # threads -> (1-token, 16-token) step, when measured


def usable_cores(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Cores this process may run on, at least 1: its CPU affinity (a container's cpuset), capped by a CPU quota
    (a container's --cpus, a pod's CPU limit), which the affinity does not show: threads past the quota are
    throttled in turns."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    quota = cpu_quota(cgroup)
    return max(min(cores, math.ceil(quota)) if quota is not None else cores, 1)


def cpu_quota(cgroup: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs' worth of time the cgroup may use (cgroup v2 cpu.max, else v1 cfs quota / period); None: no limit."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def candidates(cores: int) -> list[int]:
    """Thread counts worth measuring: powers of two up to cores - 1 (one core kept for the server), and cores - 1."""
    budget = max(cores - 1, 1)
    counts = {1, budget}
    n = 2
    while n < budget:
        counts.add(n)
        n *= 2
    return sorted(counts)


def choose(model: Transformer, setting: int | str, cores: int | None = None) -> ThreadsDecision:
    """Set torch's intra-op threads as `setting` (an int, or "auto") says; returns the decision and its reason."""
    if isinstance(setting, int):
        torch.set_num_threads(setting)
        return ThreadsDecision(setting, f"model.num_threads is {setting}")
    if model.device.type != "cpu":
        return ThreadsDecision(None, f"the model runs on {model.device.type}; host threads only launch kernels")
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) >= 1:
        torch.set_num_threads(int(env))
        return ThreadsDecision(int(env), f"OMP_NUM_THREADS={env} in the environment")
    cores = usable_cores() if cores is None else cores
    counts = candidates(cores)
    if len(counts) == 1:
        torch.set_num_threads(counts[0])
        return ThreadsDecision(counts[0], f"{cores} usable core(s), one kept for the HTTP server, tokenizer and "
                                          "scheduler")
    context = max(min(128, model.max_model_len - _WIDE_STEP - 1), 0)

    def timed(threads: int) -> float:
        torch.set_num_threads(threads)
        narrow = forward_seconds(model, context, 1, repeats=5)
        wide = forward_seconds(model, context, _WIDE_STEP, repeats=3)
        steps[threads].append((narrow, wide))
        return narrow

    steps: dict[int, list[tuple[float, float]]] = {n: [] for n in counts}
    for n in counts:  # warm-up: each count's thread pool and kernels once
        torch.set_num_threads(n)
        forward_seconds(model, context, 1, repeats=1)
    interleaved_medians([functools.partial(timed, n) for n in counts], _ROUNDS, _MIN_ROUNDS, _BUDGET_S)
    medians = {n: (statistics.median(s[0] for s in runs), statistics.median(s[1] for s in runs))
               for n, runs in steps.items()}
    best_narrow = min(m[0] for m in medians.values())
    best_wide = min(m[1] for m in medians.values())
    # the count whose worse shape is nearest its best; ties to fewer threads
    chosen = min(counts, key=lambda n: (max(medians[n][0] / best_narrow, medians[n][1] / best_wide), n))
    torch.set_num_threads(chosen)
    timings = ", ".join(f"{n}: {medians[n][0] * 1e3:.2f}/{medians[n][1] * 1e3:.2f} ms" for n in counts)
    return ThreadsDecision(chosen, f"{cores} usable cores, one kept for the server; 1-/{_WIDE_STEP}-token steps by "
                                   f"threads {timings}", {n: (m[0] * 1e3, m[1] * 1e3) for n, m in medians.items()})
