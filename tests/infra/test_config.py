"""The stack schema: every shipped stack validates; broken ones fail naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from infra.config import (
    SECRET_MASK,
    ConfigError,
    available_stacks,
    load_stack,
    masked_dump,
    render_server_config,
)
from infra.config_reference import write_or_check


@pytest.mark.parametrize("name", available_stacks())
def test_every_shipped_stack_validates(name: str) -> None:
    stack = load_stack(name)
    assert stack.config.platform in ("local", "aws", "kubernetes")


def test_the_four_environments_exist() -> None:
    assert {"local", "dev", "staging", "prod"} <= set(available_stacks())


def _write_stack(tmp_path: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    document = yaml.safe_load(Path("stacks/Pulumi.dev.yaml").read_text())
    edit(document["config"])
    (tmp_path / "Pulumi.broken.yaml").write_text(yaml.safe_dump(document))
    return tmp_path


def _error_for(tmp_path: Path, edit) -> str:  # type: ignore[no-untyped-def]
    stacks_dir = _write_stack(tmp_path, edit)
    with pytest.raises(ConfigError) as info:
        load_stack("broken", stacks_dir)
    return str(info.value)


def test_unknown_top_level_key_is_named(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda c: c.update({"specdeploy:replicaz": 3}))
    assert "specdeploy:replicaz" in message and "allowed keys" in message


def test_unknown_nested_key_is_named(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda c: c["specdeploy:scheduler"].update({"max_concurency": 4}))
    assert "specdeploy:scheduler.max_concurency: unknown key" in message


def test_negative_concurrency_is_named(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda c: c["specdeploy:scheduler"].update({"max_concurrency": -1}))
    assert "specdeploy:scheduler.max_concurrency" in message and "greater than or equal to 1" in message


def test_unknown_dtype_lists_allowed_values(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda c: c["specdeploy:model"].update({"dtype": "fp8"}))
    assert "specdeploy:model.dtype" in message and "'fp8'" in message and "'bf16'" in message


def test_draft_without_target_is_named(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda c: c.pop("specdeploy:model"))
    assert "specdeploy:model" in message and "Field required" in message


def test_draft_method_without_draft_model_is_refused(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda c: c.pop("specdeploy:draft"))
    assert "no `draft` model is configured" in message


def test_unknown_platform_lists_allowed_values(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda c: c.update({"specdeploy:platform": "gcp"}))
    assert "specdeploy:platform" in message and "'kubernetes'" in message


def test_public_aws_without_certificate_is_refused(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda c: c["specdeploy:access"].update({"public": True}))
    assert "certificate_arn" in message


def test_bad_weights_uri_is_named(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda c: c["specdeploy:model"].update({"source": "http://x/y"}))
    assert "specdeploy:model.source" in message and "s3://" in message


def test_min_size_above_max_size_is_refused(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda c: c["specdeploy:fleet"].update({"min_size": 5, "max_size": 2}))
    assert "fleet.min_size (5) exceeds fleet.max_size (2)" in message


def test_missing_stack_lists_known_stacks() -> None:
    with pytest.raises(ConfigError, match="known stacks: .*prod"):
        load_stack("nope")


def test_secure_values_are_marked_secret_and_masked() -> None:
    stack = load_stack("prod")
    assert "api_keys" in stack.secret_keys
    assert masked_dump(stack.config)["apiKeys"] == SECRET_MASK


def test_server_config_is_rendered_from_the_stack() -> None:
    config = load_stack("prod").config
    server = render_server_config(config, model_path="/m/t", draft_path="/m/d")
    assert server.scheduler == config.scheduler
    assert server.speculative.enabled and server.speculative.draft_model == "/m/d"
    assert server.model.max_memory_utilization == config.service.max_memory_utilization
    assert server.service.served_model_name == config.model.name


def test_server_config_has_no_draft_when_speculation_is_off() -> None:
    config = load_stack("prod").config
    off = config.model_copy(update={"speculative": config.speculative.model_copy(update={"enabled": False})})
    assert render_server_config(off).speculative.draft_model is None


def test_config_reference_and_pulumi_yaml_are_current() -> None:
    stale = write_or_check(check=True)
    assert not stale, f"regenerate with `specdeploy config reference`: {stale}"


def test_pulumi_yaml_declares_every_key_with_type_and_description() -> None:
    project = yaml.safe_load(Path("Pulumi.yaml").read_text())
    assert project["name"] == "specdeploy" and project["main"] == "infra/"
    assert project["stackConfigDir"] == "stacks"
    for key, declaration in project["config"].items():
        assert declaration["type"] in ("string", "integer", "boolean", "array", "object"), key
        assert declaration["description"], key
