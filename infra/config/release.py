"""Blue/green release slots: what each slot serves, which one takes traffic, and how much the other gets.

:func:`other_slot` is the one place that knows which slot is "the other one".
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from infra.config.server import check_uri
from serving.config import StrictModel

Slot = Literal["blue", "green"]
SLOTS: tuple[Slot, Slot] = ("blue", "green")  # the two release slots; import this, never retype it


def other_slot(slot: str) -> Slot:
    """The release slot that is not ``slot``: green for blue, blue for green."""
    return "green" if slot == "blue" else "blue"


class SlotServerSpec(StrictModel):
    """A slot's own server settings: keys of the stack's `scheduler` / `speculative` sections that differ on
    this slot. A change made here lands on this slot only, and reaches traffic only through a rollout."""

    scheduler: dict[str, Any] | None = Field(
        None, description="Keys of `scheduler` (e.g. max_concurrency) this slot serves with instead.")
    speculative: dict[str, Any] | None = Field(
        None, description="Keys of `speculative` (e.g. enabled, num_draft_tokens) this slot serves with instead.")


class SlotSpec(StrictModel):
    image: str = Field(..., min_length=1, description="Server image, by digest in production.")
    model_version: str = Field(..., description="Weights URI of the model version this slot serves.")
    draft_version: str | None = Field(None, description="Weights URI of the draft version, if any.")
    ami: str | None = Field(
        None, pattern=r"^ami-[0-9a-f]{8,17}$",
        description="AMI of this slot's instances (aws); default: fleet.ami_id, else resolved from SSM while the "
                    "slot is idle and kept while it carries traffic.",
    )
    server: SlotServerSpec | None = Field(
        None, description="Server settings of this slot over the stack's `scheduler` and `speculative`: the way "
                          "to canary a config change (set it on the idle slot, `pulumi up`, `specdeploy rollout`).",
    )

    @field_validator("model_version", "draft_version")
    @classmethod
    def _version_uri(cls, value: str | None) -> str | None:
        return value if value is None else check_uri(value)


class ReleaseSpec(StrictModel):
    active: Slot = Field("blue", description="Slot taking (most) traffic.")
    canary_weight: int = Field(0, ge=0, le=100, description="Percent of traffic on the idle slot.")
    blue: SlotSpec | None = Field(None, description="The blue slot.")
    green: SlotSpec | None = Field(None, description="The green slot (absent until a release).")
    gate_cidrs: list[str] | None = Field(
        None, max_length=4,
        description="Where the release tooling (the launch validation and the shift guard of `specdeploy "
                    "rollout`) reaches each slot alone from. aws: each slot's listener on the load balancer admits "
                    "these (default access.allowed_cidrs on an internal load balancer, none on a public one); "
                    "kubernetes: a NetworkPolicy rule admits them to the server port of the pods, whose "
                    "addresses the tooling then uses (pod IPs routable from there, e.g. the EKS VPC CNI).",
    )

    @field_validator("gate_cidrs")
    @classmethod
    def _cidrs(cls, value: list[str] | None) -> list[str] | None:
        import ipaddress

        for cidr in value or []:
            try:
                ipaddress.ip_network(cidr, strict=True)
            except ValueError as exc:
                raise ValueError(f"release.gate_cidrs: {cidr!r} is not a CIDR block ({exc})") from None
            if ipaddress.ip_network(cidr).prefixlen == 0:
                raise ValueError(f"release.gate_cidrs: {cidr} opens each slot's direct path to the world; "
                                 "list the networks operators and pipelines run from")
        return value

    @model_validator(mode="after")
    def _active_exists(self) -> ReleaseSpec:
        if getattr(self, self.active) is None:
            raise ValueError(f"release.active is {self.active!r} but release.{self.active} is not defined")
        idle = self.idle_slot
        if self.canary_weight and (idle is None or getattr(self, idle) is None):
            raise ValueError("release.canary_weight > 0 needs both slots defined")
        return self

    @property
    def idle_slot(self) -> Slot | None:
        return other_slot(self.active)

    def weights(self) -> dict[str, int]:
        """Percent of traffic per slot as the stack file records it."""
        return {self.active: 100 - self.canary_weight, other_slot(self.active): self.canary_weight}

    def carries_traffic(self, name: str) -> bool:
        return self.weights().get(name, 0) > 0

    def slot(self, name: str) -> SlotSpec | None:
        if name not in SLOTS:
            raise ValueError(f"unknown slot {name!r}; allowed: {', '.join(SLOTS)}")
        spec: SlotSpec | None = getattr(self, name)
        return spec
