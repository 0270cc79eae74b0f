"""The release model: slots, traffic weights, steps and observe windows.

A stack's ``specdeploy:release`` names the active slot and the canary weight (percent
of traffic on the idle slot). Everything here is pure: parsing the command's
``--steps``/``--observe`` and computing which weights and which stack-file release a
rollout or rollback leads to.
"""

from __future__ import annotations

import re

from infra.config import SLOTS, ReleaseSpec, Slot, other_slot

Weights = dict[str, int]  # slot -> percent of traffic; the two values sum to 100

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


class ReleaseError(Exception):
    """A release cannot go on; the message says why and what to do (shown as one line)."""


def as_slot(name: str) -> Slot:
    if name == "blue":
        return "blue"
    if name == "green":
        return "green"
    raise ReleaseError(f"unknown slot {name!r}; allowed: {', '.join(SLOTS)}")


def weights_to(slot: str, percent: int) -> Weights:
    """``percent`` of traffic on ``slot``, the rest on the other slot."""
    if not 0 <= percent <= 100:
        raise ReleaseError(f"traffic weight {percent} is not a percentage")
    return {slot: percent, other_slot(as_slot(slot)): 100 - percent}


def stack_weights(release: ReleaseSpec) -> Weights:
    """The traffic split the stack file asks for."""
    return weights_to(release.idle_slot or other_slot(release.active), release.canary_weight)


def parse_steps(text: str) -> list[int]:
    """``"10,50,100"`` -> [10, 50, 100]: strictly increasing percentages in 1..100."""
    try:
        steps = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ReleaseError(f"--steps {text!r}: expected comma-separated percentages, e.g. 10,50,100") from None
    if not steps:
        raise ReleaseError("--steps is empty")
    if any(not 1 <= s <= 100 for s in steps):
        raise ReleaseError(f"--steps {text!r}: every step must lie in 1..100")
    if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
        raise ReleaseError(f"--steps {text!r}: steps must increase")
    return steps


def parse_duration(text: str) -> float:
    """``"10m"``, ``"30s"``, ``"1h"``, ``"500ms"`` or plain seconds -> seconds."""
    match = _DURATION.match(text)
    if match is None:
        raise ReleaseError(f"{text!r} is not a duration; use e.g. 30s, 10m, 1h")
    return float(match.group(1)) * _UNIT_S[match.group(2) or "s"]


def after_shift(release: ReleaseSpec, to: str, percent: int) -> ReleaseSpec:
    """The stack-file release once ``percent`` of traffic is on ``to``.

    At 100 % the new slot becomes active; below, the old slot stays active and the
    new slot is recorded as a canary.
    """
    if percent >= 100:
        return release.model_copy(update={"active": to, "canary_weight": 0})
    if percent <= 0:
        return release.model_copy(update={"active": other_slot(as_slot(to)), "canary_weight": 0})
    return release.model_copy(update={"active": other_slot(as_slot(to)), "canary_weight": percent})


def rollback_target(release: ReleaseSpec, interrupted_from: str | None) -> Slot:
    """The slot a rollback returns to.

    An unfinished rollout goes back where it started; a committed canary is removed
    (back to the active slot); otherwise the previous release is the idle slot.
    """
    if interrupted_from is not None:
        return as_slot(interrupted_from)
    if release.canary_weight > 0:
        return as_slot(release.active)
    return other_slot(release.active)
