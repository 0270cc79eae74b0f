"""The release model: steps, durations, weights, and where a rollback goes."""

from __future__ import annotations

import pytest

from infra.config import ReleaseSpec, SlotSpec
from infra.ops.release.model import (
    ReleaseError,
    after_shift,
    parse_duration,
    parse_steps,
    rollback_target,
    stack_weights,
    weights_to,
)

SLOT = SlotSpec(image="img@sha256:" + "1" * 64, model_version="s3://models-bucket/m/v1")
BOTH = ReleaseSpec(active="blue", blue=SLOT, green=SLOT)


def test_steps_parse_in_order() -> None:
    assert parse_steps("10,50,100") == [10, 50, 100]


@pytest.mark.parametrize("text", ["", "50,10", "0,100", "10,101", "ten", "10,10"])
def test_bad_steps_are_refused(text: str) -> None:
    with pytest.raises(ReleaseError):
        parse_steps(text)


@pytest.mark.parametrize(("text", "seconds"), [("10m", 600), ("30s", 30), ("1h", 3600), ("500ms", 0.5), ("7", 7)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_weights_sum_to_100() -> None:
    assert weights_to("green", 10) == {"green": 10, "blue": 90}


def test_stack_weights_follow_the_canary() -> None:
    assert stack_weights(BOTH.model_copy(update={"canary_weight": 25})) == {"green": 25, "blue": 75}


def test_full_shift_makes_the_new_slot_active() -> None:
    assert after_shift(BOTH, "green", 100).active == "green"
    assert after_shift(BOTH, "green", 100).canary_weight == 0


def test_partial_shift_is_a_canary_on_the_old_slot() -> None:
    held = after_shift(BOTH, "green", 10)
    assert (held.active, held.canary_weight) == ("blue", 10)


def test_rollback_after_a_finished_release_returns_to_the_idle_slot() -> None:
    assert rollback_target(BOTH.model_copy(update={"active": "green"}), None) == "blue"


def test_rollback_of_an_interrupted_rollout_returns_where_it_started() -> None:
    assert rollback_target(BOTH, "blue") == "blue"


def test_rollback_of_a_committed_canary_keeps_the_active_slot() -> None:
    assert rollback_target(BOTH.model_copy(update={"canary_weight": 10}), None) == "blue"
