"""The release slots: one helper names the other slot, and every traffic split uses it."""

from __future__ import annotations

import pytest

from infra.config import SLOTS, ReleaseSpec, SlotSpec, other_slot


@pytest.mark.parametrize(("slot", "other"), [("blue", "green"), ("green", "blue")])
def test_other_slot_is_the_slot_that_is_not_it(slot: str, other: str) -> None:
    assert other_slot(slot) == other and other_slot(other_slot(slot)) == slot
    assert {slot, other_slot(slot)} == set(SLOTS)


def test_the_idle_slot_and_the_split_follow_the_active_slot() -> None:
    slot = SlotSpec(image="specdeploy-server:latest", model_version="file:///m")
    release = ReleaseSpec(active="green", canary_weight=10, blue=slot, green=slot)
    assert release.idle_slot == "blue"
    assert release.weights() == {"green": 90, "blue": 10}
