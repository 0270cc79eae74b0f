"""The AWS sections: the GPU fleet and its autoscaling; the load balancer's idle timeout, which the server's
keep-alive must outlast."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from serving.config import StrictModel

# AWS's advice for targets behind an ALB: keep idle connections open longer than the balancer's idle timeout,
# so the balancer, not the server, closes an idle connection (else a request sent as the server closes is a 502)
KEEP_ALIVE_MARGIN_S = 5


def load_balancer_idle_timeout_s(request_timeout_s: float) -> int:
    """The ALB's idle timeout: long prefills and slow streams sit silent for a while, so never below the server's
    own request timeout (+ 60 s), 300 s at least, and at most the 4,000 s AWS allows."""
    return min(4000, max(300, math.ceil(request_timeout_s) + 60))


_ECR_REPOSITORY = r"^[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*$"


class ScaleSchedule(StrictModel):
    name: str = Field(..., pattern=r"^[a-z0-9-]+$", description="Schedule name.")
    cron: str = Field(..., description="Cron expression (UTC) when it applies.")
    min_size: int = Field(..., ge=0, description="Baseline during the peak.")


class FleetSpec(StrictModel):
    instance_type: str = Field("auto", description="EC2 type, or `auto` for the cheapest that fits the plan.")
    min_size: int = Field(1, ge=0, le=1000, description="Baseline instances; scale-in never goes below.")
    max_size: int = Field(2, ge=1, le=1000, description="Upper bound of the autoscaling group.")
    desired_capacity: int | None = Field(None, ge=0, description="Initial size; default min_size.")
    capacity_type: Literal["on-demand", "spot", "mixed"] = Field(
        "on-demand", description="Purchase option; spot suits offline batch stacks."
    )
    on_demand_base: int = Field(1, ge=0, description="On-demand instances kept under `mixed`.")
    ami_id: str | None = Field(None, description="Fixed AMI id; default: the GPU AMI from ami_ssm_parameter.")
    ami_ssm_parameter: str = Field(
        "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id",
        description="SSM parameter resolving the GPU (Deep Learning Base) AMI.",
    )
    root_volume_gb: int = Field(200, ge=30, le=16384, description="Encrypted gp3 root, sized for weights.")
    warmup_s: int = Field(900, ge=60, description="Grace period for weight pull, load and warm-up.")
    queue_target_per_instance: float = Field(
        8.0, gt=0, description="Target tracking: waiting requests per instance."
    )
    scale_schedules: list[ScaleSchedule] = Field(
        default_factory=list, description="Known peaks: cron schedules raising min_size."
    )
    nvidia_driver_min: str | None = Field(None, description="Minimum driver version checked at boot.")
    image_repository: str | None = Field(
        None, max_length=256, pattern=_ECR_REPOSITORY,
        description="ECR repository name for the image; default specdeploy-<stack> (one per stack and account).",
    )

    @model_validator(mode="after")
    def _sizes(self) -> FleetSpec:
        if self.min_size > self.max_size:
            raise ValueError(f"fleet.min_size ({self.min_size}) exceeds fleet.max_size ({self.max_size})")
        desired = self.desired_capacity
        if desired is not None and not self.min_size <= desired <= self.max_size:
            raise ValueError(f"fleet.desired_capacity ({desired}) must lie in [min_size, max_size]")
        for index, schedule in enumerate(self.scale_schedules):
            if schedule.min_size > self.max_size:
                raise ValueError(f"fleet.scale_schedules[{index}].min_size ({schedule.min_size}) exceeds "
                                 f"fleet.max_size ({self.max_size})")
        return self
