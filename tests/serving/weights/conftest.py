from __future__ import annotations

import os
import urllib.request
from pathlib import Path

import pytest


@pytest.fixture
def s3_bucket(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    import boto3

    urllib.request.urlopen(urllib.request.Request(f"{moto_endpoint}/moto-api/reset", method="POST")).close()
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": moto_endpoint,
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    boto3.client("s3").create_bucket(Bucket="models")
    return "models"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A small version: a 'weights' file large enough for multipart, plus config and a nested file."""
    root = tmp_path / "src"
    (root / "tokenizer").mkdir(parents=True)
    (root / "config.json").write_text('{"hidden_size": 8}\n')
    (root / "tokenizer" / "vocab.txt").write_text("a\nb\nc\n")
    (root / "model.safetensors").write_bytes(os.urandom(9 * 1024 * 1024 + 123))
    return root
