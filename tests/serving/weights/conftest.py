from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A loopback moto_server for the session; each test resets it through /moto-api/reset."""
    port = _free_port()
    binary = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen(
        [str(binary), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)


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
