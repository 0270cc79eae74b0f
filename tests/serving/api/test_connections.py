"""The connection guard's bookkeeping (issue 18 item 8); the real sockets are in tests/serving/chaos."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.api.connections import ConnectionGuard
from serving.config import ConfigError, ServiceSection, load_server_config


class FakeConnection:
    def __init__(self, idle: bool) -> None:
        self.idle = idle
        self.evicted = False

    def evictable(self) -> bool:
        return self.idle and not self.evicted

    def evict(self) -> None:
        self.evicted = True


def test_at_the_cap_the_oldest_idle_unauthenticated_connection_makes_room() -> None:
    guard = ConnectionGuard(ServiceSection(max_unauthenticated_connections=2))
    busy, idle, newcomer = FakeConnection(idle=False), FakeConnection(idle=True), FakeConnection(idle=True)
    assert guard.opened(("a", 1), busy) and guard.opened(("a", 2), idle)
    assert guard.opened(("a", 3), newcomer)
    assert idle.evicted and not busy.evicted and guard.evicted_total == 1


def test_when_all_are_mid_request_the_newcomer_is_refused() -> None:
    guard = ConnectionGuard(ServiceSection(max_unauthenticated_connections=1))
    assert guard.opened(("a", 1), FakeConnection(idle=False))
    assert not guard.opened(("a", 2), FakeConnection(idle=True))
    assert guard.refused_total == 1


def test_authenticated_connections_do_not_count() -> None:
    guard = ConnectionGuard(ServiceSection(max_unauthenticated_connections=1))
    first = FakeConnection(idle=False)
    assert guard.opened(("a", 1), first)
    guard.authenticated(["a", 1])  # ASGI gives the client as a list or a tuple
    assert guard.opened(("a", 2), FakeConnection(idle=False))
    guard.closed(("a", 1))
    assert not guard.authenticated_peers


def test_the_limits_are_the_server_configs_and_the_environment_overrides_them(tmp_path: Path) -> None:
    path = tmp_path / "server.yaml"
    path.write_text("model: {path: /m}\n")
    environ = {"SPECDEPLOY__SERVICE__HEADER_TIMEOUT_S": "2.5",
               "SPECDEPLOY__SERVICE__MAX_UNAUTHENTICATED_CONNECTIONS": "7"}
    service = load_server_config(path, environ).service
    assert (service.header_timeout_s, service.body_timeout_s, service.max_unauthenticated_connections) == (2.5, 30.0, 7)
    with pytest.raises(ConfigError, match="service.body_timeout_s: Input should be a valid number"):
        load_server_config(path, {"SPECDEPLOY__SERVICE__BODY_TIMEOUT_S": "soon"})
    with pytest.raises(ConfigError, match="service.body_timeout_s: Input should be greater than 0"):
        load_server_config(path, {"SPECDEPLOY__SERVICE__BODY_TIMEOUT_S": "-1"})
