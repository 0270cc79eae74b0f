"""The launch suite's quick profile against the server image, through the operator's commands.

`specdeploy up` of a container stack (a copy of stacks/Pulumi.local-container.yaml in a temporary
project, on a free port, under its own container name), `specdeploy validate --profile quick`, then
`specdeploy down`. The gate must pass, the report must say the server was a container, and the host
checks must have run inside it (podman://), not on this machine. Skipped where no image is built,
unless SPECDEPLOY_REQUIRE_IMAGE=1 (CI), where a missing image fails. About 2-3 minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from infra.ops import image
from serving.net import free_port

pytestmark = [pytest.mark.image, pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[3]
REQUIRED = os.environ.get("SPECDEPLOY_REQUIRE_IMAGE") == "1"
STACK = "ci-container"  # its container is specdeploy-ci-container: not the one `up --stack local-container` runs
CONTAINER = f"specdeploy-{STACK}"


def _specdeploy(project: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "infra.ops.cli.main", "--project", str(project), *args],
                          cwd=project, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A project holding the container stack, brought up with `specdeploy up` and down afterwards."""
    if not image.image_exists(image.IMAGE):
        if REQUIRED:
            pytest.fail(f"image {image.IMAGE} is not built (`make image`)")
        pytest.skip(f"image {image.IMAGE} is not built (`make image`; SPECDEPLOY_REQUIRE_IMAGE=1 makes this fail)")
    root = tmp_path_factory.mktemp("validate-container")
    stack = yaml.safe_load((REPO / "stacks" / "Pulumi.local-container.yaml").read_text())
    stack["config"]["specdeploy:service"]["port"] = free_port()
    (root / "stacks").mkdir()
    (root / "stacks" / f"Pulumi.{STACK}.yaml").write_text(yaml.safe_dump(stack))
    (root / "Pulumi.yaml").write_text((REPO / "Pulumi.yaml").read_text())
    try:
        up = _specdeploy(root, "up", "--stack", STACK, timeout=900)
        assert up.returncode == 0, f"specdeploy up failed:\n{up.stdout[-3000:]}\n{up.stderr[-3000:]}"
        yield root
    finally:
        down = _specdeploy(root, "down", "--stack", STACK, timeout=120)
        image.podman("rm", "--force", "--ignore", CONTAINER, f"{CONTAINER}-twin", check=False, capture=True)
        assert down.returncode == 0, f"specdeploy down failed:\n{down.stdout[-2000:]}\n{down.stderr[-2000:]}"


def test_quick_profile_passes_against_the_container(project: Path) -> None:
    report = project / "report"
    result = _specdeploy(project, "validate", "--stack", STACK, "--profile", "quick", "--report", str(report),
                         timeout=1000)
    summary = json.loads((report / "report.json").read_text()) if (report / "report.json").is_file() else {}
    failed = [f"{c['nodeid']}: {c['message'][:200]}" for c in summary.get("checks", []) if c["outcome"] == "failed"]
    assert result.returncode == 0 and summary.get("passed"), (
        f"launch gate failed (exit {result.returncode}):\n" + "\n".join(failed) + f"\n{result.stdout[-3000:]}")
    # The report says what it ran against: the image in a container, host checks inside it.
    assert summary["server"].startswith(f"container (image {image.IMAGE}"), summary["server"]
    assert summary["hosts"] == [f"podman://{CONTAINER}"]
    assert "Server: container" in (report / "summary.md").read_text()
    host_checks = {c["nodeid"].split("::", 1)[1]: c for c in summary["checks"] if c["group"] == "host"}
    ran = {name for name, c in host_checks.items() if c["outcome"] == "passed"}
    for check in ("test_model_files_match_the_manifest[target-podman://", "test_free_disk_holds_another_model",
                  "test_no_plaintext_secrets_in_config_files", "test_api_key_file_is_not_readable_by_others",
                  "test_server_process_does_not_run_as_root"):
        assert any(name.startswith(check) for name in ran), f"{check} did not pass: {host_checks}"
    # The speculative A/B ran against a twin container, and every skip says why.
    assert summary["speculative_ab"] is not None and any("twin" in note for note in summary["notes"])
    assert all(c["message"] for c in summary["checks"] if c["outcome"] == "skipped")
