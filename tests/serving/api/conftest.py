"""The tiny random Llama (tests/conftest.py) pushed to a file:// store, served by real
`specdeploy serve` processes on loopback. No fake engine: every test here talks HTTP to the real one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from serving.net import NotReady, free_port, wait_until_ready

REPO = Path(__file__).resolve().parents[3]
MODEL_NAME = "tiny"
KEYS = {"alice": "alice-secret-key-0123456789", "bob": "bob-secret-key-abcdefghij", "slow": "slow-secret-key-zyxwvu98"}
SLOW_KEY_RPM = 2


@pytest.fixture(scope="session")
def model_store(tmp_path_factory: pytest.TempPathFactory, tiny_chat_model: Path) -> str:
    """file:// URI of the tiny model version (pushed with its manifest)."""
    from serving.weights import push

    uri = f"file://{tmp_path_factory.mktemp('weights') / 'store' / 'tiny' / 'v1'}"
    push(tiny_chat_model, uri)
    return uri


class ServerProcess:
    def __init__(self, workdir: Path, model_store: str, overrides: dict[str, dict[str, Any]] | None = None,
                 keys: str | None = None, extra_env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "server.log"
        config: dict[str, dict[str, Any]] = {
            "service": {"host": "127.0.0.1", "port": self.port, "served_model_name": MODEL_NAME,
                        "weights_uri": model_store, "max_body_bytes": 65536, "drain_grace_s": 20},
            "model": {"path": str(workdir / "cache" / "tiny"), "dtype": "fp32", "device": "cpu",
                      "kv_cache_bytes": 4 * 2**20},
            "scheduler": {"max_concurrency": 64, "max_input_len": 512, "max_output_len": 1024, "max_queue": 64,
                          "request_timeout_s": 60, "max_batched_tokens": 512},
        }
        for section, values in (overrides or {}).items():
            config.setdefault(section, {}).update(values)
        self.config_path = workdir / "server.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEPLOY")}
        env["SPECDEPLOY_API_KEYS"] = keys if keys is not None else (
            f"alice:{KEYS['alice']},bob:{KEYS['bob']},slow:{KEYS['slow']}:{SLOW_KEY_RPM}")
        env.update(extra_env or {})
        self.log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "infra.ops.cli.main", "serve", "--config", str(self.config_path)],
            cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT,
        )

    def client(self, key: str | None = KEYS["alice"], timeout: float = 60) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)

    def wait_ready(self, timeout: float = 120) -> None:
        try:
            wait_until_ready(self.base_url, timeout, self.proc, poll_s=0.2)
        except NotReady as exc:
            raise RuntimeError(f"{exc}:\n{self.log_text()}") from exc

    def log_text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.base_url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return int(self.proc.returncode)


def _serving(workdir: Path, model_store: str, overrides: dict[str, dict[str, Any]]) -> Iterator[ServerProcess]:
    proc = ServerProcess(workdir, model_store, overrides=overrides)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, model_store: str) -> Iterator[ServerProcess]:
    """The shared server: roomy limits, three API keys (one rate-limited)."""
    yield from _serving(tmp_path_factory.mktemp("server"), model_store, {"model": {"max_model_len": 1100}})


def demo_pair_present() -> bool:
    from serving.demo import draft_path, target_path

    return all((p / "model.safetensors").is_file() for p in (target_path(), draft_path()))


@pytest.fixture(scope="session")
def demo_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """file:// URI of the demo target pushed with its manifest, and a copy of the demo draft with one."""
    import shutil

    from serving.demo import draft_path, target_path
    from serving.weights import MANIFEST_NAME, build_manifest, push

    if not demo_pair_present():
        pytest.skip("demo target/draft weights not present")
    workdir = tmp_path_factory.mktemp("demo-store")
    store = f"file://{workdir / 'store' / 'demo' / 'v1'}"
    push(target_path(), store)
    draft = workdir / "draft"
    shutil.copytree(draft_path(), draft)
    (draft / MANIFEST_NAME).write_text(build_manifest(draft).to_json())  # verified at start-up as a model is
    return store, draft


DEMO_LIMITS = {"model": {"max_model_len": 1100, "kv_cache_bytes": 64 * 2**20}}


@pytest.fixture(scope="session")
def spec_server(tmp_path_factory: pytest.TempPathFactory, demo_store: tuple[str, Path]) -> Iterator[ServerProcess]:
    """The demo target and draft with speculation on as the AWS and Kubernetes stacks run it: a draft model, k up
    to 12 chosen by the adaptive policy (what issue 37 was measured with)."""
    store, draft = demo_store
    yield from _serving(tmp_path_factory.mktemp("spec"), store, {**DEMO_LIMITS, "speculative": {
        "enabled": True, "method": "draft", "draft_model": str(draft), "num_draft_tokens": 12, "adaptive": True,
        "draft_rollout": "off"}})


@pytest.fixture(scope="module")
def fixed_spec_server(
    tmp_path_factory: pytest.TempPathFactory, demo_store: tuple[str, Path]
) -> Iterator[ServerProcess]:
    """The demo pair drafting a fixed k = 4 on every step: no policy or guard decides, so a request that takes the
    speculative path drafts whatever the load and the machine's speed (the adaptive spec_server may, rightly, stop
    drafting at c = 1 on a slow or noisy machine, and then no single request is sure to draft)."""
    store, draft = demo_store
    yield from _serving(tmp_path_factory.mktemp("fixed-spec"), store, {**DEMO_LIMITS, "speculative": {
        "enabled": True, "method": "draft", "draft_model": str(draft), "num_draft_tokens": 4, "adaptive": False,
        "draft_rollout": "off"}})


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory: pytest.TempPathFactory, demo_store: tuple[str, Path]) -> Iterator[ServerProcess]:
    """The demo target without speculation."""
    yield from _serving(tmp_path_factory.mktemp("demo"), demo_store[0], DEMO_LIMITS)


@pytest.fixture(scope="session")
def small_server(tmp_path_factory: pytest.TempPathFactory, model_store: str) -> Iterator[ServerProcess]:
    """A 0.5 s request timeout and room for 1500 output tokens: a long request must time out. (1 s was not
    enough once: on a quiet machine the tiny model generated all 1500 tokens in under a second.)"""
    yield from _serving(tmp_path_factory.mktemp("small"), model_store, {
        "scheduler": {"max_concurrency": 4, "max_queue": 4, "max_output_len": 1500, "max_input_len": 256,
                      "request_timeout_s": 0.5},
    })


@pytest.fixture(scope="module")
def capacity_server(tmp_path_factory: pytest.TempPathFactory, model_store: str) -> Iterator[ServerProcess]:
    """Capacity 2 running + 2 queued: for overload; the drain test ends it with SIGTERM."""
    yield from _serving(tmp_path_factory.mktemp("capacity"), model_store, {
        "scheduler": {"max_concurrency": 2, "max_queue": 2, "request_timeout_s": 60},
        "service": {"drain_grace_s": 30},
    })


@pytest.fixture(scope="session")
def api_keys() -> dict[str, str]:
    return dict(KEYS)


@pytest.fixture(scope="session")
def model_name() -> str:
    return MODEL_NAME
