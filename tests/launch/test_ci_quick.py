"""CI gate: the quick profile against a real local deployment of the demo pair, end to end
(and, under `make soak`, the standard profile).

The deployment is the local stack's chain on a free loopback port: the bundled demo weights are
pushed to a file:// store and pulled back (hash-verified, manifest.json in place), the server config
is rendered from stacks/Pulumi.local.yaml, the server runs as an unprivileged user when the test
runs as root (the host checks require it), then ``run_validation(..., profile="quick")`` runs the
whole launch suite in its own pytest process and the gate must pass. Not part of the launch suite
itself (no ``launch`` marker); skipped where the launch suite is pointed at a deployment already.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infra.config import load_stack, render_server_config
from infra.runtime.process import ServerProcess, run_as
from infra.validation import run_validation
from serving.net import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NOBODY = (65534, 65534)
READY_TIMEOUT_S = 240


def _deploy_files(root: Path, stack: Any) -> tuple[Path, str]:
    """Push/pull the demo pair through a file:// store, write keys and the server config."""
    from serving.demo import draft_path, target_path
    from serving.weights import pull, push

    models = {"target": target_path()}
    if (draft_path() / "config.json").is_file():
        models["draft"] = draft_path()
    for role, source in models.items():
        uri = f"file://{root}/store/demo-{role}/v1"
        push(source, uri)
        pull(uri, root / "models" / role)
    key = secrets.token_hex(24)
    keys_file = root / "secrets" / "api_keys"
    keys_file.parent.mkdir()
    keys_file.write_text(f"ci:{key}\n", encoding="utf-8")
    keys_file.chmod(0o600)
    config = stack
    if "draft" not in models:  # the demo draft is not trained yet: serve the target alone
        config = stack.model_copy(update={"speculative": stack.speculative.model_copy(update={"enabled": False})})
    server_config = render_server_config(
        config, model_path=str(root / "models" / "target"),
        draft_path=str(root / "models" / "draft") if "draft" in models else None, host=stack.local.host,
        kv_cache_bytes=stack.local.kv_cache_mb * 2**20, api_keys_file=str(keys_file))
    config_dir = root / "config"
    config_dir.mkdir()
    path = config_dir / "server.yaml"
    path.write_text(server_config.to_yaml(), encoding="utf-8")
    return path, key


@pytest.fixture(scope="module")
def local_deployment(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    if request.config.getoption("endpoint", None):
        pytest.skip("the launch suite is pointed at a deployment already (--endpoint)")
    from infra.ops.cli.main import registered_commands

    if "serve" not in registered_commands():
        pytest.skip("`specdeploy serve` is not part of this build")
    stack = load_stack("local").config
    # Not under pytest's tmp dir: that is private to root, and the server may run as nobody.
    root = Path(tempfile.mkdtemp(prefix="specdeploy-ci-"))
    config_path, key = _deploy_files(root, stack)
    user = NOBODY if os.geteuid() == 0 else None
    if user is not None:
        root.chmod(0o755)
        for path in [root, *root.rglob("*")]:
            os.chown(path, *user)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(root), "SPECDEPLOY_ENV": "production"}
    # The interpreter of this machine lives under /root (mode 0700): the unprivileged server keeps
    # CAP_DAC_READ_SEARCH to reach it. A real host installs the server outside any private home.
    wrapper = run_as(*user, read_anywhere=True) if user else []
    server = ServerProcess(config_path, free_port(stack.local.host), env, root / "server.log",
                           host=stack.local.host, wrapper=wrapper)
    server.start(READY_TIMEOUT_S)
    try:
        yield server.endpoint, key
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def _gate(endpoint: str, key: str, profile: str, report_dir: Path) -> None:
    result = run_validation(endpoint, "local", profile, report_dir, api_key=key)
    assert result.summary, f"no report written (pytest exit code {result.exit_code})"
    assert result.report_html.is_file() and result.report_markdown.is_file()
    failures = [f"{c['nodeid'].split('::', 1)[1]}: {c['message'][:160]}" for c in result.summary["checks"]
                if c["outcome"] == "failed"]
    assert result.passed, f"launch gate failed ({result.report_markdown}):\n" + "\n".join(failures)


def test_quick_profile_passes_against_the_local_deployment(local_deployment: tuple[str, str],
                                                           tmp_path: Path) -> None:
    _gate(*local_deployment, "quick", tmp_path / "report")


@pytest.mark.soak
@pytest.mark.timeout(4 * 3600)
def test_standard_profile_passes_against_the_local_deployment(local_deployment: tuple[str, str],
                                                              tmp_path: Path) -> None:
    """The guide's launch bar on the demo pair: >= 15 minutes sustained, full A/B (`make soak`).

    The report is kept where ``SPECDEPLOY_SOAK_REPORT`` points (``make soak`` sets reports/soak-<time>),
    so its figures outlive pytest's temporary directories.
    """
    report_dir = Path(os.environ.get("SPECDEPLOY_SOAK_REPORT") or tmp_path / "report")
    _gate(*local_deployment, "standard", report_dir)
