"""GPU instance catalog for the capacity plan: what each EC2 type offers one server.

Figures are per GPU (the bundled engine serves one model from one GPU; it does
not shard), with the instance's host memory and its us-east-1 on-demand Linux
list price. Prices change: they rank candidates and size the cost line of the
plan, they are not a bill. Bandwidth is the GPU's HBM/GDDR bandwidth, which
bounds batch-1 decode speed (guide, section 3.4).
"""

from __future__ import annotations

from dataclasses import dataclass

# Prices: USD per hour, us-east-1 on-demand Linux, list prices of 2025 (P4d/P5 after the June 2025 cut).
CATALOG_PRICE_DATE = "2025-06"


@dataclass(frozen=True)
class InstanceType:
    name: str  # EC2 instance type, e.g. g6e.xlarge
    gpu: str  # accelerator model
    gpus: int  # GPUs on the instance
    gpu_memory_gib: float  # memory of one GPU
    bandwidth_gb_s: float  # memory bandwidth of one GPU, GB/s
    vcpus: int
    memory_gib: float  # host memory
    price_per_hour: float  # USD, on-demand

    @property
    def family(self) -> str:
        return self.name.split(".", 1)[0]


def _family(prefix: str, gpu: str, gib: float, bandwidth: float,
            sizes: list[tuple[str, int, int, float, float]]) -> list[InstanceType]:
    return [InstanceType(f"{prefix}.{size}", gpu, gpus, gib, bandwidth, vcpus, mem, price)
            for size, gpus, vcpus, mem, price in sizes]


CATALOG: tuple[InstanceType, ...] = tuple(
    # size, gpus, vcpus, host GiB, $/h
    _family("g5", "NVIDIA A10G", 24, 600, [
        ("xlarge", 1, 4, 16, 1.006), ("2xlarge", 1, 8, 32, 1.212), ("4xlarge", 1, 16, 64, 1.624),
        ("8xlarge", 1, 32, 128, 2.448), ("12xlarge", 4, 48, 192, 5.672), ("48xlarge", 8, 192, 768, 16.288),
    ])
    + _family("g6", "NVIDIA L4", 24, 300, [
        ("xlarge", 1, 4, 16, 0.805), ("2xlarge", 1, 8, 32, 0.978), ("4xlarge", 1, 16, 64, 1.323),
        ("8xlarge", 1, 32, 128, 2.014), ("12xlarge", 4, 48, 192, 4.602), ("48xlarge", 8, 192, 768, 13.350),
    ])
    + _family("g6e", "NVIDIA L40S", 48, 864, [
        ("xlarge", 1, 4, 32, 1.861), ("2xlarge", 1, 8, 64, 2.242), ("4xlarge", 1, 16, 128, 3.004),
        ("8xlarge", 1, 32, 256, 4.529), ("12xlarge", 4, 48, 384, 10.493), ("48xlarge", 8, 192, 1536, 30.131),
    ])
    + _family("p4d", "NVIDIA A100 40GB", 40, 1555, [("24xlarge", 8, 96, 1152, 21.958)])
    # p5.4xlarge (one H100, 2025): priced here as one eighth of p5.48xlarge, which is what AWS lists per GPU.
    + _family("p5", "NVIDIA H100 80GB", 80, 3350, [("4xlarge", 1, 16, 256, 6.880), ("48xlarge", 8, 192, 2048, 55.040)])
)

_BY_NAME = {item.name: item for item in CATALOG}


def instance_type(name: str) -> InstanceType | None:
    """The catalog entry of an EC2 type, or None when it is not a catalogued GPU type."""
    return _BY_NAME.get(name)


def instance_names() -> list[str]:
    return [item.name for item in CATALOG]
