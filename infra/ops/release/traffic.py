"""The two platform interfaces a rollout needs: where traffic goes, and which alarms fire.

An implementation per platform: :mod:`infra.ops.release.aws` (ALB listener weights,
CloudWatch alarms) and :mod:`infra.ops.release.kubernetes` (ingress-nginx canary weight,
Prometheus alerts). The orchestration in :mod:`infra.ops.release.rollout` sees only these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from infra.ops.release.model import Weights


@dataclass(frozen=True)
class SlotStatus:
    ready: bool  # deployed, with at least one ready instance / pod, nothing half-rolled
    detail: str  # one line for the operator: counts and what is missing
    endpoints: list[str] = field(default_factory=list)  # base URLs reaching this slot alone, if discoverable


@dataclass(frozen=True)
class FiringAlarm:
    name: str
    reason: str


class TrafficRouter(Protocol):
    """Splits requests between the blue and green slots."""

    description: str  # e.g. "ALB listener arn:…", for logs

    def weights(self) -> Weights:
        """Percent of traffic per slot as the platform routes it now."""
        ...

    def set_weights(self, weights: Weights) -> None:
        """Route ``weights`` — in exactly one API call, so a shift is atomic."""
        ...

    def slot_status(self, slot: str) -> SlotStatus:
        """Whether ``slot`` is deployed and ready to take traffic."""
        ...


class AlarmActions(Protocol):
    """Who gets paged: the alarms of the slots carrying traffic, never those of an idle slot."""

    def follow(self, weights: Weights) -> dict[str, bool]:
        """Enable the alarm actions of slots with traffic and disable them at 0 %; slot -> enabled."""
        ...


class AlarmSource(Protocol):
    """The stack's alarms (CloudWatch alarms, or Prometheus alerts from the same rules)."""

    def watched(self) -> list[str]:
        """Names of the alarms this source watches (for the log and the pre-flight check)."""
        ...

    def firing(self) -> list[FiringAlarm]:
        """Alarms currently in ALARM / firing."""
        ...
