"""A server configured for CUDA that finds no CUDA device stays up, never ready, and /ready says why
(the load balancer keeps it out of service, the lifecycle hook never completes, the reason is in
/ready and the log) — it does not quietly serve on the CPU. Start-up runs for real, in process."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from serving.api.settings import Settings
from serving.config import ServerConfig
from serving.main import create_app


def test_cuda_configured_server_without_cuda_is_not_ready_and_says_why(
        model_store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = ServerConfig.model_validate({
        "service": {"weights_uri": model_store, "served_model_name": "tiny"},
        "model": {"path": str(tmp_path / "cache" / "tiny"), "dtype": "fp32", "device": "cuda"},
    })
    with TestClient(create_app(Settings(config=config, environment="development"))) as client:
        deadline = time.monotonic() + 60
        while not (body := client.get("/ready").json())["failed"] and time.monotonic() < deadline:
            time.sleep(0.05)
        response = client.get("/ready")
        health = client.get("/health")
    assert response.status_code == 503
    reason = response.json()["reason"]
    assert reason.startswith("start-up failed during loading model"), reason
    assert "model.device is cuda" in reason and "finds no CUDA device" in reason
    assert body["failed"] is True
    assert health.status_code == 200  # alive (not restarted in a loop), just never ready
