"""Every object `specdeploy preview --render-k8s` writes is valid for the clusters we support.

Built-in kinds pass kubernetes-validate in strict mode (misspelt fields and strings where
integers belong fail) for two Kubernetes versions; the Prometheus Operator kinds pass the
JSON schemas kept in tests/infra/components/kubernetes/schemas/. The stacks run through the real program
(infra/__main__.py) under the offline preview's recording mocks.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from infra.ops.k8s_render import render_objects, write_manifests
from infra.program.preview import record_stack, secret_placeholders

STACKS = ("k8s-dev", "k8s-prod")
VERSIONS = ("1.30.0", "1.33.0")
SCHEMAS = Path(__file__).resolve().parent / "schemas"
CUSTOM_KINDS = {"PrometheusRule": "prometheusrule-monitoring-v1.json",
                "ServiceMonitor": "servicemonitor-monitoring-v1.json"}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {stack: render_objects((r.type, r.inputs) for r in record_stack(stack).resources) for stack in STACKS}


def _schema(kind: str) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((SCHEMAS / CUSTOM_KINDS[kind]).read_text())
    return schema


def _strict_errors(manifest: dict[str, Any], version: str) -> str | None:
    try:
        kubernetes_validate.validate(manifest, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return f"{manifest['kind']}/{manifest['metadata']['name']}: {'.'.join(map(str, exc.path))}: {exc.message}"
    return None


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("stack", STACKS)
def test_built_in_objects_pass_strict_validation(rendered: dict[str, list[dict[str, Any]]], stack: str,
                                                 version: str) -> None:
    built_in = [m for m in rendered[stack] if m["kind"] not in CUSTOM_KINDS]
    errors = [e for e in (_strict_errors(m, version) for m in built_in) if e]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("stack", STACKS)
def test_custom_resources_pass_the_schemas_in_the_repo(rendered: dict[str, list[dict[str, Any]]], stack: str) -> None:
    custom = [m for m in rendered[stack] if m["kind"] in CUSTOM_KINDS]
    assert sorted(m["kind"] for m in custom) == ["PrometheusRule", "PrometheusRule", "ServiceMonitor"]
    for manifest in custom:
        jsonschema.Draft202012Validator(_schema(manifest["kind"])).validate(manifest)


def test_prod_renders_every_expected_object(rendered: dict[str, list[dict[str, Any]]]) -> None:
    # Server ConfigMaps carry a content hash: compare their names without it.
    kinds = sorted((m["kind"], re.sub(r"-config-[0-9a-f]{10}$", "-config", m["metadata"]["name"]))
                   for m in rendered["k8s-prod"])
    assert kinds == sorted([
        ("Namespace", "specdeploy"), ("ServiceAccount", "specdeploy-server"),
        ("ConfigMap", "specdeploy-blue-config"), ("ConfigMap", "specdeploy-green-config"),
        ("ConfigMap", "specdeploy-dashboard"),
        ("PersistentVolumeClaim", "specdeploy-blue-weights"), ("PersistentVolumeClaim", "specdeploy-green-weights"),
        ("Service", "specdeploy-blue"), ("Service", "specdeploy-green"),
        ("Deployment", "specdeploy-blue"), ("Deployment", "specdeploy-green"),
        ("HorizontalPodAutoscaler", "specdeploy-blue"), ("HorizontalPodAutoscaler", "specdeploy-green"),
        ("PodDisruptionBudget", "specdeploy-blue"), ("PodDisruptionBudget", "specdeploy-green"),
        ("NetworkPolicy", "specdeploy-server"), ("Ingress", "specdeploy"), ("Ingress", "specdeploy-canary"),
        ("PrometheusRule", "specdeploy-alerts"), ("ServiceMonitor", "specdeploy"),
        ("Role", "specdeploy-release"), ("RoleBinding", "specdeploy-release"),
        ("PrometheusRule", "specdeploy-traffic"),
    ])


def test_every_namespaced_object_is_in_the_stack_namespace(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for manifest in rendered["k8s-dev"]:
        if manifest["kind"] != "Namespace":
            assert manifest["metadata"]["namespace"] == "specdeploy-dev", manifest["metadata"]["name"]


@pytest.mark.parametrize("stack", STACKS)
def test_api_keys_are_never_rendered(rendered: dict[str, list[dict[str, Any]]], stack: str) -> None:
    from infra.config import load_stack

    text = yaml.safe_dump_all(rendered[stack])
    assert all(m["kind"] != "Secret" for m in rendered[stack])
    for placeholder in secret_placeholders(load_stack(stack)):
        assert placeholder not in text
    assert "[secret]" not in text


def test_strict_validation_rejects_a_string_where_an_integer_belongs(rendered: dict[str, list[dict[str, Any]]]) -> None:
    deployment = copy.deepcopy(next(m for m in rendered["k8s-prod"] if m["kind"] == "Deployment"))
    deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "75"
    assert _strict_errors(deployment, VERSIONS[0])


def test_strict_validation_rejects_a_misspelt_field(rendered: dict[str, list[dict[str, Any]]]) -> None:
    service = copy.deepcopy(next(m for m in rendered["k8s-prod"] if m["kind"] == "Service"))
    service["spec"]["selectr"] = service["spec"].pop("selector")
    assert _strict_errors(service, VERSIONS[-1])


def test_rule_schema_rejects_a_misspelt_field(rendered: dict[str, list[dict[str, Any]]]) -> None:
    rule = copy.deepcopy(next(m for m in rendered["k8s-prod"] if m["kind"] == "PrometheusRule"
                              and m["metadata"]["name"] == "specdeploy-alerts"))
    rule["spec"]["groups"][0]["rules"][0]["annotation"] = rule["spec"]["groups"][0]["rules"][0].pop("annotations")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(_schema("PrometheusRule")).validate(rule)


def test_monitor_schema_rejects_a_bad_duration(rendered: dict[str, list[dict[str, Any]]]) -> None:
    monitor = copy.deepcopy(next(m for m in rendered["k8s-prod"] if m["kind"] == "ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(_schema("ServiceMonitor")).validate(monitor)


def test_manifests_are_written_one_file_per_object_in_apply_order(rendered: dict[str, list[dict[str, Any]]],
                                                                  tmp_path: Path) -> None:
    paths = write_manifests(rendered["k8s-prod"], tmp_path)
    assert [p.name for p in paths] == sorted(p.name for p in tmp_path.iterdir())
    assert paths[0].name == "01-namespace-specdeploy.yaml"
    assert [yaml.safe_load(p.read_text()) for p in paths] == rendered["k8s-prod"]


VARIANTS = {
    "host-path-cache": ("k8s-dev", {"kubernetes": {"weight_cache": "hostPath"}}),
    "cpu-only-no-gpu": ("k8s-dev", {"kubernetes": {"gpus_per_pod": 0, "node_selector": {}, "tolerations": []}}),
    "metrics-auth": ("k8s-dev", {"service": {"metrics_require_auth": True}}),
    "green-active-full-canary": ("k8s-prod", {"release": {"active": "green", "canary_weight": 100}}),
    "no-speculation": ("k8s-prod", {"speculative": {"enabled": False}}),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_config_variants_render_valid_objects(name: str, render: Any, variant_config: Any) -> None:
    stack, sections = VARIANTS[name]
    objects = render(stack, variant_config(stack, **sections)).manifests
    errors = [e for e in (_strict_errors(m, VERSIONS[-1]) for m in objects if m["kind"] not in CUSTOM_KINDS) if e]
    assert not errors, "\n".join(errors)
    for manifest in objects:
        if manifest["kind"] in CUSTOM_KINDS:
            jsonschema.Draft202012Validator(_schema(manifest["kind"])).validate(manifest)
