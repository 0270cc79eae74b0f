"""Chaos and fuzz tests run real `specdeploy serve` processes on loopback (the API tests' launcher)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serving.api.conftest import ServerProcess, model_store  # noqa: F401 - the fixture, re-exported


def serving(workdir: Path, store: str, overrides: dict[str, dict[str, object]] | None = None,
            env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    proc = ServerProcess(workdir, store, overrides=overrides or {}, extra_env=env)  # type: ignore[arg-type]
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def chaos_server(tmp_path_factory: pytest.TempPathFactory, model_store: str) -> Iterator[ServerProcess]:  # noqa: F811
    """Short header/body timeouts and a small cap on unauthenticated connections."""
    yield from serving(tmp_path_factory.mktemp("chaos"), model_store, {"model": {"max_model_len": 1100}}, {
        "SPECDEPLOY__SERVICE__HEADER_TIMEOUT_S": "1", "SPECDEPLOY__SERVICE__BODY_TIMEOUT_S": "1",
        "SPECDEPLOY__SERVICE__MAX_UNAUTHENTICATED_CONNECTIONS": "20"})
