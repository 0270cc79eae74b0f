"""The built server image, run for real under podman (`make image` first).

The deployment is the `local-container` stack's chain in a temporary root on a free port: the demo
pair pushed to a file:// store and pulled back, the weights mounted read-only, the API keys from a
file, the config from $SPECDEPLOY_CONFIG. Skipped where no image is built, unless
SPECDEPLOY_REQUIRE_IMAGE=1 (CI), where a missing image fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.config import load_stack
from infra.ops import image
from infra.ops.local import LocalDeployment
from infra.runtime.podman import podman_env
from serving.net import free_port

pytestmark = [pytest.mark.image, pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[3]
REQUIRED = os.environ.get("SPECDEPLOY_REQUIRE_IMAGE") == "1"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    if not image.image_exists(image.IMAGE):
        if REQUIRED:
            pytest.fail(f"image {image.IMAGE} is not built (`make image`)")
        pytest.skip(f"image {image.IMAGE} is not built (`make image`)")
    root = tmp_path_factory.mktemp("container")
    stack_text = yaml.safe_load((REPO / "stacks" / "Pulumi.local-container.yaml").read_text())
    stack_text["config"]["specdeploy:service"]["port"] = free_port()
    (root / "stacks").mkdir()
    (root / "stacks" / "Pulumi.local-container.yaml").write_text(yaml.safe_dump(stack_text))
    (root / "Pulumi.yaml").write_text((REPO / "Pulumi.yaml").read_text())
    local = LocalDeployment(load_stack("local-container", root / "stacks"))
    import serving.demo

    try:
        local.up(serving.demo.target_path(), serving.demo.draft_path())
        yield local
    finally:
        local.down()
        if local.container is not None:
            local.container.remove()


def _inspect(name: str) -> dict[str, Any]:
    data: list[dict[str, Any]] = json.loads(image.podman("container", "inspect", name, capture=True))
    return data[0]


def _exec(local: LocalDeployment, *command: str) -> subprocess.CompletedProcess[str]:
    assert local.container is not None
    return subprocess.run(["podman", "exec", local.container.name, *command], env=podman_env(),
                          capture_output=True, text=True, timeout=60)


def _key(local: LocalDeployment) -> str:
    key = local.api_key()
    assert key
    return key


def _chat(local: LocalDeployment, max_tokens: int = 8) -> dict[str, Any]:
    body = json.dumps({"model": local.config.model.name, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "def reverse(xs):"}]}).encode()
    request = urllib.request.Request(f"{local.endpoint}/v1/chat/completions", data=body, method="POST", headers={
        "Authorization": f"Bearer {_key(local)}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        result: dict[str, Any] = json.loads(response.read())
        return result


def test_image_is_within_its_size_budget() -> None:
    image.check_size(image.image_size())


def test_image_holds_no_secrets_tests_weights_or_pip_configuration(tmp_path: Path) -> None:
    if not image.image_exists(image.IMAGE):
        pytest.skip("no image")
    assert image.scan_filesystem(image.export_filesystem(image.IMAGE, tmp_path / "fs.tar")) == []


def test_container_is_ready_and_serves_with_a_key_from_the_file(deployment: LocalDeployment) -> None:
    assert deployment.status().is_ready
    assert _chat(deployment)["choices"][0]["message"]["content"] is not None


def test_server_runs_as_the_image_user_not_root(deployment: LocalDeployment) -> None:
    status = deployment.status()
    uids = Path(f"/proc/{status.pid}/status").read_text().split("Uid:")[1].split()[:4]
    assert set(uids) == {"10001"}


def test_config_comes_from_specdeploy_config_not_a_command(deployment: LocalDeployment) -> None:
    assert deployment.container is not None
    config = _inspect(deployment.container.name)["Config"]
    assert "SPECDEPLOY_CONFIG=/etc/specdeploy/server.yaml" in config["Env"]
    assert not config.get("Cmd")


def test_image_carries_no_infra(deployment: LocalDeployment) -> None:
    result = _exec(deployment, "python3", "-c", "import infra")
    assert result.returncode != 0 and "No module named 'infra'" in result.stderr


def test_weights_are_mounted_read_only(deployment: LocalDeployment) -> None:
    result = _exec(deployment, "touch", "/data/models/target/written-by-server")
    assert result.returncode != 0 and "Read-only file system" in result.stderr


def test_healthcheck_runs_and_passes(deployment: LocalDeployment) -> None:
    assert deployment.container is not None
    assert deployment.container.healthcheck()


def test_stop_drains_in_flight_requests_and_exits_zero(deployment: LocalDeployment) -> None:
    """Last in the file: stops the container. Requests in flight at `podman stop` all complete."""
    assert deployment.container is not None and shutil.which("podman")
    results: list[Any] = []

    def request() -> None:
        try:
            results.append(_chat(deployment, max_tokens=48))
        except Exception as exc:  # recorded, asserted below
            results.append(exc)

    threads = [threading.Thread(target=request) for _ in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(1.5)  # the requests are admitted and decoding
    code = deployment.container.stop()
    for thread in threads:
        thread.join(timeout=deployment.config.service.drain_grace_s + 30)
    assert code == 0
    assert len(results) == 4 and all(isinstance(r, dict) for r in results), results
