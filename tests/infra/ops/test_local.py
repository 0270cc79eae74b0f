"""`specdeploy up/status/down --stack local` for real: a stack file in a scratch checkout, the tiny
model as target and draft, a server process on loopback."""

from __future__ import annotations

import argparse
import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from infra.config import load_stack, project_stacks_dir
from infra.ops.cli import local_cmd
from infra.ops.cli.main import CommandError
from infra.ops.local import LocalDeployment, LocalError
from serving.net import free_port

# The tests on the started deployment are the slow tier (`make test-slow`): starting it takes ~30 s here.
end_to_end = pytest.mark.slow


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scratch checkout: stacks/Pulumi.local.yaml as shipped, on a free port, small KV cache."""
    root = tmp_path_factory.mktemp("checkout")
    (root / "stacks").mkdir()
    document = yaml.safe_load((project_stacks_dir() / "Pulumi.local.yaml").read_text())
    document["config"]["specdeploy:service"]["port"] = free_port()
    document["config"]["specdeploy:local"]["kv_cache_mb"] = 8
    (root / "stacks" / "Pulumi.local.yaml").write_text(yaml.safe_dump(document))
    aws = yaml.safe_load((project_stacks_dir() / "Pulumi.dev.yaml").read_text())
    (root / "stacks" / "Pulumi.dev.yaml").write_text(yaml.safe_dump(aws))
    return root


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    local_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(list(argv))
    return int(args.func(args))


@pytest.fixture(scope="module")
def tiny_draft(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model as the draft, with the demo draft's token map (same tokenizer), which the local stack names."""
    import shutil

    from serving.demo import DEMO_TOKEN_MAP, draft_path

    draft = tmp_path_factory.mktemp("tiny-draft") / "draft"
    shutil.copytree(tiny_chat_model, draft)
    shutil.copy(draft_path() / DEMO_TOKEN_MAP, draft / DEMO_TOKEN_MAP)
    return draft


@pytest.fixture(scope="module")
def deployment(checkout: Path, tiny_chat_model: Path, tiny_draft: Path) -> Iterator[LocalDeployment]:
    stacks = str(checkout / "stacks")
    model = str(tiny_chat_model)
    assert _run("up", "--stack", "local", "--stacks-dir", stacks, "--target-dir", model, "--draft-dir", str(tiny_draft),
                "--quiet", "--timeout", "180") == 0
    deployment = LocalDeployment(load_stack("local", checkout / "stacks"))
    try:
        yield deployment
    finally:
        deployment.down(timeout_s=30)


@end_to_end
def test_up_serves_the_stack_model_with_the_generated_key(deployment: LocalDeployment) -> None:
    key = deployment.api_key()
    assert key
    response = httpx.post(f"{deployment.endpoint}/v1/chat/completions", timeout=60,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"model": deployment.config.model.name, "max_tokens": 4,
                                "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200, response.text
    assert httpx.post(f"{deployment.endpoint}/v1/completions", json={"model": "x", "prompt": "a"}).status_code == 401


@end_to_end
def test_up_binds_loopback_and_keeps_state_under_the_state_dir(deployment: LocalDeployment, checkout: Path) -> None:
    state = checkout / ".specdeploy" / "local"
    assert deployment.paths.state_dir == state
    assert deployment.endpoint.startswith("http://127.0.0.1:")
    for name in ("server.pid", "server.log", "server.yaml", "api_keys"):
        assert (state / name).is_file(), name
    assert stat.S_IMODE((state / "api_keys").stat().st_mode) == 0o600
    rendered = yaml.safe_load((state / "server.yaml").read_text())
    assert rendered["service"]["host"] == "127.0.0.1"
    assert rendered["model"]["path"] == str(state / "models" / "target")
    assert rendered["speculative"]["draft_model"] == str(state / "models" / "draft")


@end_to_end
def test_weights_went_through_the_file_store_with_manifests(deployment: LocalDeployment, checkout: Path) -> None:
    from serving.weights import verify_dir

    store = checkout / ".specdeploy" / "store"
    assert (store / "demo-target" / "v1" / "manifest.json").is_file()
    assert (store / "demo-draft" / "v1" / "manifest.json").is_file()
    verify_dir(deployment.paths.models_dir / "target")
    verify_dir(deployment.paths.models_dir / "draft")


@end_to_end
def test_status_reports_ready_and_up_again_is_a_noop(deployment: LocalDeployment, checkout: Path,
                                                     tiny_chat_model: Path, tiny_draft: Path) -> None:
    stacks = str(checkout / "stacks")
    assert _run("status", "--stack", "local", "--stacks-dir", stacks) == 0
    pid = deployment.status().pid
    assert _run("up", "--stack", "local", "--stacks-dir", stacks, "--target-dir", str(tiny_chat_model),
                "--draft-dir", str(tiny_draft), "--quiet") == 0
    assert deployment.status().pid == pid


@end_to_end
def test_log_never_contains_the_key(deployment: LocalDeployment) -> None:
    key = deployment.api_key()
    assert key and key not in deployment.paths.log_file.read_text()


@end_to_end
def test_speculative_counters_are_exported_when_the_stack_enables_speculation(deployment: LocalDeployment) -> None:
    text = httpx.get(f"{deployment.endpoint}/metrics", timeout=10).text
    for name in ("specdeploy_spec_drafts_total", "specdeploy_spec_draft_tokens_total",
                 "specdeploy_spec_accepted_tokens_total", "specdeploy_spec_guard_cycles_total",
                 "specdeploy_spec_guard_vetoed_cycles_total"):
        assert f"\n{name} " in text, name


@end_to_end
def test_down_drains_and_stops_then_status_says_not_running(deployment: LocalDeployment, checkout: Path) -> None:
    stacks = str(checkout / "stacks")
    pid = deployment.status().pid
    assert pid is not None
    assert _run("down", "--stack", "local", "--stacks-dir", stacks) == 0
    assert not deployment.status().running
    assert not deployment.paths.pid_file.exists()
    assert _run("status", "--stack", "local", "--stacks-dir", stacks) == 1
    assert "drained: exiting" in deployment.paths.log_file.read_text()


def test_non_local_stack_is_refused(checkout: Path) -> None:
    with pytest.raises(LocalError, match="use `pulumi up`"):
        LocalDeployment(load_stack("dev", checkout / "stacks"))
    with pytest.raises(CommandError, match="platform"):
        _run("up", "--stack", "dev", "--stacks-dir", str(checkout / "stacks"))


def test_missing_model_directory_is_a_clear_error(checkout: Path, tmp_path: Path) -> None:
    with pytest.raises(CommandError, match="has no config.json"):
        _run("up", "--stack", "local", "--stacks-dir", str(checkout / "stacks"), "--target-dir", str(tmp_path),
             "--draft-dir", str(tmp_path), "--quiet")
