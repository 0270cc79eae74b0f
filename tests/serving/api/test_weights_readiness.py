"""The server refuses readiness on any weights mismatch, naming the file, and never serves a partial
version. Start-up runs for real (pull + verify); it stops before the engine is built."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from serving.api.settings import Settings
from serving.config import ServerConfig
from serving.main import create_app


def _store_path(uri: str) -> Path:
    return Path(uri.removeprefix("file://"))


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _refuse_engine(settings: Settings) -> Any:
    raise AssertionError("the engine must not be built from unverified weights")


def _ready_reason(config: ServerConfig) -> tuple[int, str]:
    app = create_app(Settings(config=config, environment="development"), engine_factory=_refuse_engine)
    with TestClient(app) as client:
        deadline = time.monotonic() + 30
        while True:
            response = client.get("/ready")
            body = response.json()
            # the engine factory refuses, so every start-up here ends failed: on the weights or on the engine
            if body["failed"] or time.monotonic() > deadline:
                return response.status_code, body["reason"]
            time.sleep(0.05)


@pytest.fixture
def store_copy(model_store: str, tmp_path: Path) -> Path:
    copy = tmp_path / "store"
    shutil.copytree(_store_path(model_store), copy)
    return copy


def _config(tmp_path: Path, uri: str | None, path: Path | None = None) -> ServerConfig:
    return ServerConfig.model_validate({
        "service": {"weights_uri": uri, "served_model_name": "tiny"},
        "model": {"path": str(path or tmp_path / "cache" / "tiny"), "dtype": "fp32", "device": "cpu"},
    })


CORRUPTIONS: list[tuple[str, Callable[[Path], None], str]] = [
    ("flipped-byte", lambda store: _flip(store / "model.safetensors"), "model.safetensors: sha256"),
    ("truncated", lambda store: (store / "config.json").write_text("{}"), "config.json: size 2 bytes"),
    ("missing", lambda store: (store / "tokenizer.json").unlink(), "tokenizer.json: missing"),
    ("wrong-manifest", lambda store: (store / "manifest.json").write_text('{"format": 1, "files": []}'),
     "manifest.json: 'files' must be a non-empty list"),
]


@pytest.mark.parametrize(("corrupt", "message"), [c[1:] for c in CORRUPTIONS], ids=[c[0] for c in CORRUPTIONS])
def test_corrupt_store_refuses_readiness_naming_the_file_and_leaves_no_partial_version(
    store_copy: Path, tmp_path: Path, corrupt: Callable[[Path], None], message: str
) -> None:
    corrupt(store_copy)
    status, reason = _ready_reason(_config(tmp_path, f"file://{store_copy}"))
    assert status == 503
    assert reason.startswith("weights verification failed")
    assert message in reason
    cache = tmp_path / "cache"
    assert not (cache / "tiny").exists()
    # the pull lock file (.<name>.lock) may stay; no version and no staging directory may
    assert not cache.exists() or [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_tampered_local_version_refuses_readiness(store_copy: Path, tmp_path: Path) -> None:
    from serving.weights import pull

    local = tmp_path / "local" / "tiny"
    pull(f"file://{store_copy}", local)
    _flip(local / "model.safetensors")
    status, reason = _ready_reason(_config(tmp_path, None, local))
    assert status == 503
    assert "model.safetensors: sha256" in reason


def test_directory_without_manifest_refuses_readiness(tmp_path: Path) -> None:
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text("{}")
    status, reason = _ready_reason(_config(tmp_path, None, tmp_path / "bare"))
    assert status == 503
    assert "manifest.json: manifest missing" in reason


def test_health_stays_up_while_not_ready(tmp_path: Path) -> None:
    app = create_app(Settings(config=_config(tmp_path, None, tmp_path / "nothing"), environment="development"),
                     engine_factory=_refuse_engine)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        response = client.post("/v1/completions", json={"model": "tiny", "prompt": "a"})
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "not_ready"
        assert response.headers["retry-after"]
