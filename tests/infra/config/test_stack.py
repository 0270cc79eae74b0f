"""The stack schema: every shipped stack validates; broken ones fail naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from infra.config import (
    SECRET_MASK,
    ConfigError,
    ServiceSpec,
    SpeculativeSpec,
    StackConfig,
    available_stacks,
    load_stack,
    masked_dump,
    render_server_config,
)
from infra.config.reference import write_or_check
from serving.config import ModelSection, SchedulerSection, ServiceSection, SpeculativeSection


@pytest.mark.parametrize("name", available_stacks())
def test_every_shipped_stack_validates(name: str) -> None:
    stack = load_stack(name)
    assert stack.config.platform in ("local", "aws", "kubernetes")


def test_the_four_environments_exist() -> None:
    assert {"local", "dev", "staging", "prod"} <= set(available_stacks())


def _write_stack(tmp_path: Path, edit, base: str = "dev") -> Path:  # type: ignore[no-untyped-def]
    document = yaml.safe_load(Path(f"stacks/Pulumi.{base}.yaml").read_text())
    edit(document["config"])
    (tmp_path / "Pulumi.broken.yaml").write_text(yaml.safe_dump(document))
    return tmp_path


def _error_for(tmp_path: Path, edit, base: str = "dev") -> str:  # type: ignore[no-untyped-def]
    stacks_dir = _write_stack(tmp_path, edit, base)
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


# Invariants `pulumi up` used to find first, in the components: `config validate` now refuses them.


def test_zero_kubernetes_replicas_is_refused(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda c: c["specdeploy:kubernetes"].update({"min_replicas": 0}), "k8s-dev")
    assert "specdeploy:kubernetes.min_replicas" in message and "greater than or equal to 1" in message


def test_kubernetes_min_replicas_above_max_is_refused(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda c: c["specdeploy:kubernetes"].update({"min_replicas": 3}), "k8s-dev")
    assert "kubernetes.min_replicas (3) exceeds kubernetes.max_replicas (2)" in message


def test_scale_schedule_above_max_size_is_refused(tmp_path: Path) -> None:
    peak = {"name": "peak", "cron": "0 8 * * *", "min_size": 5}
    message = _error_for(tmp_path, lambda c: c["specdeploy:fleet"].update({"scale_schedules": [peak]}))
    assert "fleet.scale_schedules[0].min_size (5) exceeds fleet.max_size (1)" in message


@pytest.mark.parametrize("base", ["dev", "k8s-dev"])
def test_draft_speculation_without_a_draft_version_is_refused(tmp_path: Path, base: str) -> None:
    message = _error_for(tmp_path, lambda c: c["specdeploy:release"]["blue"].pop("draft_version"), base)
    assert "release.blue.draft_version is required" in message


def test_ngram_speculation_needs_no_draft_version(tmp_path: Path) -> None:
    def ngram(config: dict) -> None:  # type: ignore[type-arg]
        config["specdeploy:speculative"]["method"] = "ngram"
        config["specdeploy:release"]["blue"].pop("draft_version")

    assert load_stack("broken", _write_stack(tmp_path, ngram)).config.speculative.method == "ngram"


def test_aws_alarms_that_reach_nobody_are_refused(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda c: c["specdeploy:alerting"].update({"emails": [], "https_endpoints": []}))
    assert "platform aws needs alerting.emails or alerting.https_endpoints" in message


def test_a_pager_endpoint_alone_is_an_alert_target(tmp_path: Path) -> None:
    def pager_only(config: dict) -> None:  # type: ignore[type-arg]
        config["specdeploy:alerting"].update({"emails": [], "https_endpoints": ["https://pager.example.com/hook"]})

    assert load_stack("broken", _write_stack(tmp_path, pager_only)).config.alerting.emails == []


def test_kubernetes_alerts_need_no_aws_targets(tmp_path: Path) -> None:
    def no_targets(config: dict) -> None:  # type: ignore[type-arg]
        config.setdefault("specdeploy:alerting", {}).update({"emails": [], "https_endpoints": []})

    assert load_stack("broken", _write_stack(tmp_path, no_targets, "k8s-dev")).config.platform == "kubernetes"


def test_internal_aws_endpoint_open_to_the_world_is_refused(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda c: c["specdeploy:access"].update({"allowed_cidrs": ["0.0.0.0/0"]}))
    assert "access.allowed_cidrs opens an internal load balancer to the world" in message


def test_empty_allow_list_is_refused(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda c: c["specdeploy:access"].update({"allowed_cidrs": []}))
    assert "specdeploy:access.allowed_cidrs" in message and "at least 1 item" in message


def test_gateway_routing_with_a_source_allow_list_is_refused(tmp_path: Path) -> None:
    gateway = {"routing": "gateway-api", "gateway": "gateways/internal"}
    message = _error_for(tmp_path, lambda c: c["specdeploy:kubernetes"].update(gateway), "k8s-dev")
    assert "access.allowed_cidrs cannot be enforced by an HTTPRoute" in message


def test_existing_vpc_needs_private_subnets(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda c: c["specdeploy:access"].update({"vpc_id": "vpc-0abc"}))
    assert "access.private_subnet_ids is required when access.vpc_id is given" in message


def test_invalid_image_repository_name_is_named(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda c: c["specdeploy:fleet"].update({"image_repository": "Specdeploy Server"}))
    assert "specdeploy:fleet.image_repository" in message


def test_step_budget_below_concurrency_is_refused(tmp_path: Path) -> None:
    budget = {"max_batched_tokens": 16, "max_concurrency": 32}
    message = _error_for(tmp_path, lambda c: c["specdeploy:scheduler"].update(budget))
    assert "scheduler.max_batched_tokens (16) is below scheduler.max_concurrency (32)" in message


def test_kv_block_size_must_be_a_power_of_two(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda c: c["specdeploy:scheduler"].update({"kv_block_size": 24}))
    assert "specdeploy:scheduler.kv_block_size" in message and "power of two" in message


def test_stack_service_limits_are_the_server_configs(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda c: c["specdeploy:service"].update({"max_memory_utilization": 0.99}))
    assert "specdeploy:service.max_memory_utilization" in message and "less than or equal to 0.95" in message


def test_stack_speculation_accepts_the_servers_ngram_keys(tmp_path: Path) -> None:
    def ngram(config: dict) -> None:  # type: ignore[type-arg]
        config["specdeploy:speculative"].update({"method": "ngram", "ngram_min": 2, "ngram_max": 3})

    config = load_stack("broken", _write_stack(tmp_path, ngram)).config
    server = render_server_config(config)
    assert (server.speculative.ngram_min, server.speculative.ngram_max, server.speculative.draft_model) == (2, 3, None)


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


def test_stack_sections_share_the_server_defaults() -> None:
    service, server_service, model = ServiceSpec(), ServiceSection(), ModelSection(path="/m")
    assert (service.port, service.drain_grace_s, service.metrics_require_auth) == (
        server_service.port, server_service.drain_grace_s, server_service.metrics_require_auth)
    assert service.max_memory_utilization == model.max_memory_utilization
    assert SpeculativeSection(**SpeculativeSpec().model_dump()) == SpeculativeSection()
    assert StackConfig.model_fields["scheduler"].annotation is SchedulerSection


def test_the_stacks_thread_count_reaches_the_server_config(tmp_path: Path) -> None:
    assert render_server_config(load_stack("dev").config).model.num_threads == "auto"  # the default: decided there
    stacks_dir = _write_stack(tmp_path, lambda c: c["specdeploy:model"].update({"num_threads": 6}))
    assert render_server_config(load_stack("broken", stacks_dir).config).model.num_threads == 6


def test_a_draft_thread_count_is_refused_by_name(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda c: c["specdeploy:draft"].update({"num_threads": 2}))
    assert "draft.num_threads" in message and "set model.num_threads" in message


def test_the_stacks_connection_limits_reach_the_server_config(tmp_path: Path) -> None:
    defaults = render_server_config(load_stack("dev").config).service
    server = ServiceSection()
    assert (defaults.header_timeout_s, defaults.body_timeout_s, defaults.max_unauthenticated_connections) == (
        server.header_timeout_s, server.body_timeout_s, server.max_unauthenticated_connections)
    stacks_dir = _write_stack(tmp_path, lambda c: c.setdefault("specdeploy:service", {}).update(
        {"header_timeout_s": 5, "body_timeout_s": 12.5, "max_unauthenticated_connections": 64}))
    rendered = render_server_config(load_stack("broken", stacks_dir).config).service
    assert (rendered.header_timeout_s, rendered.body_timeout_s, rendered.max_unauthenticated_connections) == (
        5, 12.5, 64)


def test_a_connection_limit_out_of_bounds_is_refused_by_name(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda c: c.setdefault("specdeploy:service", {}).update(
        {"max_unauthenticated_connections": 0}))
    assert "max_unauthenticated_connections" in message
