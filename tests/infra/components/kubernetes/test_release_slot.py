"""The release slot's Deployment, ConfigMap and Service (stack k8s-prod, slot green unless named)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import Any

import pulumi
import pytest
import yaml

from infra.components.kubernetes.common import cache_dir, startup_budget_s, termination_grace_s
from infra.components.kubernetes.release_slot import PULL_ALLOWANCE_S
from infra.config import load_stack, render_server_config

PROD = load_stack("k8s-prod").config
GREEN = PROD.slots.green
assert GREEN is not None


def _pod(prod: Any, check: Callable[[Any], None]) -> pulumi.Output[None]:
    return prod().stack.slots["green"].deployment.spec.apply(lambda spec: check(spec.template.spec))


def _both(first: pulumi.Output[Any], second: pulumi.Output[Any],
          check: Callable[[Any, Any], None]) -> pulumi.Output[None]:
    # Output.all hands over plain dicts; nested applies keep the typed output objects.
    return first.apply(lambda a: second.apply(lambda b: check(a, b)))


def _server(prod: Any, check: Callable[[Any], None]) -> pulumi.Output[None]:
    return _pod(prod, lambda pod: check(next(c for c in pod.containers if c.name == "server")))


@pulumi.runtime.test
def test_server_requests_and_limits_the_configured_gpus(prod: Any) -> pulumi.Output[None]:
    def check(server: Any) -> None:
        assert server.resources.requests["nvidia.com/gpu"] == "1"
        assert server.resources.limits["nvidia.com/gpu"] == "1"
    return _server(prod, check)


@pulumi.runtime.test
def test_server_cpu_and_memory_requests_equal_limits(prod: Any) -> pulumi.Output[None]:
    def check(server: Any) -> None:
        assert server.resources.requests["cpu"] == server.resources.limits["cpu"] == "12"
        assert server.resources.requests["memory"] == server.resources.limits["memory"] == "96Gi"
    return _server(prod, check)


@pulumi.runtime.test
def test_pods_select_gpu_nodes(prod: Any) -> pulumi.Output[None]:
    def check(pod: Any) -> None:
        assert pod.node_selector == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    return _pod(prod, check)


@pulumi.runtime.test
def test_pods_tolerate_the_gpu_taint(prod: Any) -> pulumi.Output[None]:
    def check(pod: Any) -> None:
        assert [(t.key, t.operator, t.effect) for t in pod.tolerations] == [("nvidia.com/gpu", "Exists", "NoSchedule")]
    return _pod(prod, check)


@pulumi.runtime.test
def test_replicas_spread_softly_over_nodes_and_zones(prod: Any) -> pulumi.Output[None]:
    def check(pod: Any) -> None:
        spread = {(c.topology_key, c.when_unsatisfiable, c.max_skew) for c in pod.topology_spread_constraints}
        assert spread == {("kubernetes.io/hostname", "ScheduleAnyway", 1),
                          ("topology.kubernetes.io/zone", "ScheduleAnyway", 1)}
        assert all(c.label_selector.match_labels["specdeploy.dev/slot"] == "green"
                   for c in pod.topology_spread_constraints)
    return _pod(prod, check)


@pulumi.runtime.test
def test_pod_runs_as_non_root(prod: Any) -> pulumi.Output[None]:
    def check(pod: Any) -> None:
        assert pod.security_context.run_as_non_root is True
        assert pod.security_context.run_as_user > 0
        assert all(c.security_context.run_as_non_root for c in pod.containers + pod.init_containers)
    return _pod(prod, check)


@pulumi.runtime.test
def test_every_container_has_a_read_only_root_filesystem(prod: Any) -> pulumi.Output[None]:
    def check(pod: Any) -> None:
        containers = pod.containers + pod.init_containers
        assert all(c.security_context.read_only_root_filesystem is True for c in containers)
        assert all(c.security_context.allow_privilege_escalation is False for c in containers)
        assert all(c.security_context.capabilities.drop == ["ALL"] for c in containers)
    return _pod(prod, check)


@pulumi.runtime.test
def test_init_containers_run_exactly_the_weights_pull_command(prod: Any) -> pulumi.Output[None]:
    def check(pod: Any) -> None:
        commands = {c.name: c.command for c in pod.init_containers}
        assert commands == {
            "pull-target": ["python3", "-m", "serving.weights", "pull", GREEN.model_version,
                            cache_dir(GREEN.model_version)],
            "pull-draft": ["python3", "-m", "serving.weights", "pull", GREEN.draft_version,
                           cache_dir(str(GREEN.draft_version))],
        }
    return _pod(prod, check)


@pulumi.runtime.test
def test_weights_are_pulled_into_the_cache_volume_the_server_reads_read_only(prod: Any) -> pulumi.Output[None]:
    def check(pod: Any) -> None:
        for init in pod.init_containers:
            assert {(m.name, m.mount_path, bool(m.read_only)) for m in init.volume_mounts} >= {
                ("weights", "/data/models", False)}
        server = next(c for c in pod.containers if c.name == "server")
        assert ("weights", "/data/models", True) in {(m.name, m.mount_path, m.read_only) for m in server.volume_mounts}
    return _pod(prod, check)


@pulumi.runtime.test
def test_prod_cache_is_a_shared_claim_of_the_configured_class(prod: Any) -> pulumi.Output[None]:
    claim = prod().stack.slots["green"].cache_claim
    assert claim is not None

    def check(spec: Any) -> None:
        assert spec.storage_class_name == "efs-sc"
        assert spec.access_modes == ["ReadWriteMany"]
        assert spec.resources.requests["storage"] == "200Gi"
    return claim.spec.apply(check)


@pulumi.runtime.test
def test_prod_pods_mount_their_slot_claim(prod: Any) -> pulumi.Output[None]:
    def check(pod: Any) -> None:
        weights = next(v for v in pod.volumes if v.name == "weights")
        assert weights.persistent_volume_claim.claim_name == "specdeploy-green-weights"
    return _pod(prod, check)


@pytest.mark.parametrize(("cache", "expected"), [
    ("emptyDir", {"emptyDir": {"sizeLimit": "200Gi"}}),
    ("hostPath", {"hostPath": {"path": "/var/cache/specdeploy/models", "type": "DirectoryOrCreate"}}),
])
def test_cache_volume_follows_the_config(cache: str, expected: dict[str, Any], render: Any,
                                         variant_config: Any) -> None:
    built = render("k8s-prod", variant_config("k8s-prod", kubernetes={"weight_cache": cache}))
    volumes = built.one("Deployment", "specdeploy-green")["spec"]["template"]["spec"]["volumes"]
    weights = next(v for v in volumes if v["name"] == "weights")
    assert {k: v for k, v in weights.items() if k != "name"} == expected
    assert built.objects("PersistentVolumeClaim") == []


@pulumi.runtime.test
def test_config_map_holds_the_rendered_server_config(prod: Any) -> pulumi.Output[None]:
    expected = render_server_config(
        PROD,
        model_path=cache_dir(GREEN.model_version),
        draft_path=cache_dir(str(GREEN.draft_version)),
        api_keys_file="/etc/specdeploy/secrets/api-keys",
    ).to_yaml()

    def check(data: dict[str, str]) -> None:
        assert data["server.yaml"] == expected
    return prod().stack.slots["green"].config_map.data.apply(check)


@pulumi.runtime.test
def test_server_config_points_at_the_pulled_versions(prod: Any) -> pulumi.Output[None]:
    def check(data: dict[str, str]) -> None:
        server = yaml.safe_load(data["server.yaml"])
        assert server["model"]["path"] == cache_dir(GREEN.model_version)
        assert server["speculative"]["draft_model"] == cache_dir(str(GREEN.draft_version))
        assert server["service"]["port"] == 8000
    return prod().stack.slots["green"].config_map.data.apply(check)


@pulumi.runtime.test
def test_server_starts_from_the_mounted_config(prod: Any) -> pulumi.Output[None]:
    def check(server: Any) -> None:
        assert server.command == ["python3", "-m", "serving", "--config", "/etc/specdeploy/server.yaml"]
        mounts = {(m.name, m.mount_path, m.read_only) for m in server.volume_mounts}
        assert ("config", "/etc/specdeploy", True) in mounts
    return _server(prod, check)


@pulumi.runtime.test
def test_config_map_is_immutable_and_named_by_its_content(prod: Any) -> pulumi.Output[None]:
    config_map = prod().stack.slots["green"].config_map

    def check(metadata: Any, data: dict[str, str]) -> None:
        digest = hashlib.sha256(data["server.yaml"].encode()).hexdigest()
        assert metadata.name == f"specdeploy-green-config-{digest[:10]}"
    return _both(config_map.metadata, config_map.data, check)


@pulumi.runtime.test
def test_config_map_is_immutable(prod: Any) -> pulumi.Output[None]:
    def check(immutable: Any) -> None:
        assert immutable is True
    return prod().stack.slots["green"].config_map.immutable.apply(check)


@pulumi.runtime.test
def test_pods_mount_their_slot_config_map(prod: Any) -> pulumi.Output[None]:
    slot = prod().stack.slots["green"]

    def check(metadata: Any, spec: Any) -> None:
        volume = next(v for v in spec.template.spec.volumes if v.name == "config")
        assert volume.config_map.name == metadata.name
    return _both(slot.config_map.metadata, slot.deployment.spec, check)


@pulumi.runtime.test
def test_probes_use_ready_for_readiness_and_health_for_liveness(prod: Any) -> pulumi.Output[None]:
    def check(server: Any) -> None:
        assert server.readiness_probe.http_get.path == "/ready"
        assert server.liveness_probe.http_get.path == "/health"
        assert server.startup_probe.http_get.path == "/ready"  # bounds load + warm-up, see the component
    return _server(prod, check)


@pulumi.runtime.test
def test_startup_budget_covers_weight_load_and_warm_up(prod: Any) -> pulumi.Output[None]:
    # 8.03B + 1.24B params in bf16 = 18.5 GB at 0.5 GB/s = 38 s, plus 300 s warm-up.
    assert startup_budget_s(PROD) == 338

    def check(server: Any) -> None:
        probe = server.startup_probe
        assert probe.period_seconds * probe.failure_threshold >= startup_budget_s(PROD)
        assert probe.failure_threshold == math.ceil(338 / probe.period_seconds)
    return _server(prod, check)


@pulumi.runtime.test
def test_rollout_deadline_covers_a_cold_pull_and_the_startup_budget(prod: Any) -> pulumi.Output[None]:
    def check(spec: Any) -> None:
        assert spec.progress_deadline_seconds == startup_budget_s(PROD) + PULL_ALLOWANCE_S == 938
    return prod().stack.slots["green"].deployment.spec.apply(check)


@pulumi.runtime.test
def test_termination_grace_covers_pre_stop_and_the_server_drain(prod: Any) -> pulumi.Output[None]:
    def check(pod: Any) -> None:
        server = next(c for c in pod.containers if c.name == "server")
        pre_stop = int(server.lifecycle.pre_stop.exec_.command[-1])
        assert pod.termination_grace_period_seconds == termination_grace_s(PROD) == 75
        assert pod.termination_grace_period_seconds >= pre_stop + PROD.service.drain_grace_s
    return _pod(prod, check)


@pulumi.runtime.test
def test_api_keys_come_from_the_existing_secret_as_a_file(prod: Any) -> pulumi.Output[None]:
    def check(pod: Any) -> None:
        volume = next(v for v in pod.volumes if v.name == "api-keys")
        assert volume.secret.secret_name == "specdeploy-api-keys"
        server = next(c for c in pod.containers if c.name == "server")
        assert all(e.name != "SPECDEPLOY_API_KEYS" for e in server.env or [])
    return _pod(prod, check)


@pulumi.runtime.test
def test_weight_store_credentials_reach_only_the_pull(dev: Any) -> pulumi.Output[None]:
    def check(spec: Any) -> None:
        pod = spec.template.spec
        assert all(i.env_from[0].secret_ref.name == "specdeploy-weights-reader" for i in pod.init_containers)
        assert all(not c.env_from for c in pod.containers)
    return dev().stack.slots["blue"].deployment.spec.apply(check)


@pulumi.runtime.test
def test_workload_identity_stack_mounts_no_static_credentials(prod: Any) -> pulumi.Output[None]:
    def check(pod: Any) -> None:
        assert all(not c.env_from for c in pod.containers + pod.init_containers)
    return _pod(prod, check)


@pulumi.runtime.test
def test_service_targets_the_slot_pods_on_the_named_port(prod: Any) -> pulumi.Output[None]:
    slot = prod().stack.slots["green"]

    def check(service: Any, deployment: Any) -> None:
        assert service.selector == deployment.selector.match_labels
        assert service.selector["specdeploy.dev/slot"] == "green"
        assert [(p.name, p.port, p.target_port) for p in service.ports] == [("http", 8000, "http")]
    return _both(slot.service.spec, slot.deployment.spec, check)


@pulumi.runtime.test
def test_rollout_never_drops_below_the_current_capacity(prod: Any) -> pulumi.Output[None]:
    def check(spec: Any) -> None:
        assert spec.strategy.rolling_update.max_unavailable == 0
        assert spec.replicas == PROD.kubernetes.min_replicas
    return prod().stack.slots["green"].deployment.spec.apply(check)
