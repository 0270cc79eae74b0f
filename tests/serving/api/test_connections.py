"""The connection guard's bookkeeping (issue 18 item 8); the real sockets are in tests/serving/chaos."""

from __future__ import annotations

import pytest

from serving.api.connections import ConnectionGuard, ConnectionLimits


class FakeConnection:
    def __init__(self, idle: bool) -> None:
        self.idle = idle
        self.evicted = False

    def evictable(self) -> bool:
        return self.idle and not self.evicted

    def evict(self) -> None:
        self.evicted = True


def test_at_the_cap_the_oldest_idle_unauthenticated_connection_makes_room() -> None:
    guard = ConnectionGuard(ConnectionLimits(max_unauthenticated=2))
    busy, idle, newcomer = FakeConnection(idle=False), FakeConnection(idle=True), FakeConnection(idle=True)
    assert guard.opened(("a", 1), busy) and guard.opened(("a", 2), idle)
    assert guard.opened(("a", 3), newcomer)
    assert idle.evicted and not busy.evicted and guard.evicted_total == 1


def test_when_all_are_mid_request_the_newcomer_is_refused() -> None:
    guard = ConnectionGuard(ConnectionLimits(max_unauthenticated=1))
    assert guard.opened(("a", 1), FakeConnection(idle=False))
    assert not guard.opened(("a", 2), FakeConnection(idle=True))
    assert guard.refused_total == 1


def test_authenticated_connections_do_not_count() -> None:
    guard = ConnectionGuard(ConnectionLimits(max_unauthenticated=1))
    first = FakeConnection(idle=False)
    assert guard.opened(("a", 1), first)
    guard.authenticated(["a", 1])  # ASGI gives the client as a list or a tuple
    assert guard.opened(("a", 2), FakeConnection(idle=False))
    guard.closed(("a", 1))
    assert not guard.authenticated_peers


def test_limits_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEPLOY_HEADER_TIMEOUT_S", "2.5")
    monkeypatch.setenv("SPECDEPLOY_MAX_UNAUTHENTICATED_CONNECTIONS", "7")
    limits = ConnectionLimits.from_env()
    assert (limits.header_timeout_s, limits.body_timeout_s, limits.max_unauthenticated) == (2.5, 30.0, 7)
    monkeypatch.setenv("SPECDEPLOY_BODY_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="SPECDEPLOY_BODY_TIMEOUT_S='soon' is not a number"):
        ConnectionLimits.from_env()
    monkeypatch.setenv("SPECDEPLOY_BODY_TIMEOUT_S", "-1")
    with pytest.raises(ValueError, match="must be positive"):
        ConnectionLimits.from_env()
