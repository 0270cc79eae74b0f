"""How many oneDNN primitives a CPU server keeps, bounded once at start-up.

oneDNN, which runs the packed matmuls (`cpu_linear.py`) and some of torch's dense CPU ops, builds a primitive
for every input shape it meets and caches it twice: in oneDNN's own primitive cache and in ideep's (torch's
oneDNN wrapper) LRU cache, 1,024 entries each unless the environment says otherwise. A decoding server meets a
new row count at almost every step size: b sequences verifying k_i + 1 tokens each, a prefill chunk of any
length. Each row count makes one primitive per weight shape, and each of them holds about 0.6 MiB (the demo
target's five weight shapes at 208 row counts held 601 MiB more). Under sustained load resident memory
therefore climbed for minutes toward a ceiling of a gigabyte or more, which is what a leak check sees.

Both caches are bounded at `ENTRIES` (64: about a dozen recent row counts of a model's five weight shapes).
The cost is a rebuild when an evicted shape returns, ~0.3-0.45 ms per matmul on the demo target against
0.04-0.8 ms for the matmul itself: paid once per step per weight shape, since a step's layers share their
shapes. Measured with the demo pair, k <= 12, four closed-loop clients: resident memory flat from 20 s on
(±2 MiB against +18-20 MiB over 70 s), requests served within the run-to-run spread of the unbounded caches.

Both libraries read their capacity from the environment when they build their first primitive, so this runs
before the engine loads anything. An operator's `ONEDNN_PRIMITIVE_CACHE_CAPACITY` or `LRU_CACHE_CAPACITY`
wins, as OMP_NUM_THREADS does for the thread count. In a process that had already run oneDNN ops (a test
session building several engines) the first capacity stays in force.
"""

from __future__ import annotations

import os

import torch

ENTRIES = 64
VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's cache, ideep's cache


def bound(device: torch.device) -> tuple[str, str]:
    """Set both cache capacities unless the environment already does; returns (what is in force, why)."""
    if device.type != "cpu":
        return "unbounded", f"on {device.type} the matmuls do not go through oneDNN"
    preset = {name: os.environ[name] for name in VARIABLES if name in os.environ}
    for name in VARIABLES:
        os.environ.setdefault(name, str(ENTRIES))
    if preset:
        given = ", ".join(f"{name}={value}" for name, value in preset.items())
        return (" / ".join(os.environ[name] for name in VARIABLES) + " entries",
                f"{given} from the environment")
    return (f"{ENTRIES} entries", "one primitive per row count and weight shape, ~0.6 MiB each: unbounded, "
            "resident memory grows for minutes under varied batches")
