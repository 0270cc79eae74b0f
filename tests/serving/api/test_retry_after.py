"""Retry-After on 429/503 (issue 18 item 9)."""

from __future__ import annotations


def test_retry_after_before_any_request_finished_follows_the_running_ones() -> None:
    """Issue 18 item 9: Retry-After was 1 s while admitted requests took seconds (no finished request yet)."""
    from serving.api.metrics import ServerMetrics
    from serving.api.run import _retry_after
    from serving.api.settings import Settings
    from serving.api.state import ServerState

    state = ServerState(settings=object.__new__(Settings), metrics=ServerMetrics(speculative=False))
    assert _retry_after(state) == 1.0
    state.begin_request("old")
    state.active["old"] -= 4.0  # began four seconds ago and is still running
    assert _retry_after(state) >= 4.0
    state.end_request(6.0, "old")
    assert _retry_after(state) == 6.0 and not state.active
