"""Recorded Pulumi inputs back into Kubernetes objects."""

from __future__ import annotations

from infra.ops.k8s_render import (
    SECRET_MASK,
    SECRET_SIG,
    SECRET_SIG_KEY,
    api_version_and_kind,
    render_objects,
    to_manifest,
)


def test_core_group_objects_say_v1() -> None:
    assert api_version_and_kind("kubernetes:core/v1:Service") == ("v1", "Service")


def test_named_groups_keep_their_group() -> None:
    assert api_version_and_kind("kubernetes:networking.k8s.io/v1:Ingress") == ("networking.k8s.io/v1", "Ingress")
    assert api_version_and_kind("kubernetes:monitoring.coreos.com/v1:PrometheusRule") == (
        "monitoring.coreos.com/v1", "PrometheusRule")


def test_other_resources_are_not_kubernetes_objects() -> None:
    assert api_version_and_kind("aws:s3/bucket:Bucket") is None
    assert api_version_and_kind("specdeploy:kubernetes:ReleaseSlot") is None
    assert api_version_and_kind("pulumi:providers:kubernetes") is None


def test_integral_floats_become_integers() -> None:
    manifest = to_manifest("kubernetes:apps/v1:Deployment", {"metadata": {"name": "d"}, "spec": {"replicas": 2.0}})
    assert manifest == {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
                        "spec": {"replicas": 2}}
    assert isinstance(manifest["spec"]["replicas"], int)


def test_fractions_and_strings_are_kept() -> None:
    manifest = to_manifest("kubernetes:core/v1:ConfigMap", {"data": {"ratio": 0.5, "cpu": "2"}})
    assert manifest is not None
    assert manifest["data"] == {"ratio": 0.5, "cpu": "2"}


def test_secret_values_are_masked() -> None:
    secret = {SECRET_SIG_KEY: SECRET_SIG, "value": "hunter2"}
    manifest = to_manifest("kubernetes:core/v1:ConfigMap", {"metadata": {"name": "c"}, "data": {"k": secret}})
    assert manifest is not None
    assert manifest["data"] == {"k": SECRET_MASK}


def test_objects_come_out_in_apply_order() -> None:
    records = [
        ("kubernetes:apps/v1:Deployment", {"metadata": {"name": "d", "namespace": "n"}}),
        ("aws:s3/bucket:Bucket", {"bucket": "b"}),
        ("kubernetes:core/v1:Namespace", {"metadata": {"name": "n"}}),
    ]
    assert [m["kind"] for m in render_objects(records)] == ["Namespace", "Deployment"]
