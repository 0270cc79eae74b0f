"""Namespace, NetworkPolicy and PodDisruptionBudgets."""

from __future__ import annotations

from typing import Any

import pulumi


@pulumi.runtime.test
def test_network_policy_selects_every_server_pod(prod: Any) -> pulumi.Output[None]:
    def check(spec: Any) -> None:
        assert spec.pod_selector.match_labels == {
            "app.kubernetes.io/name": "specdeploy", "app.kubernetes.io/component": "server"}
        assert spec.policy_types == ["Ingress"]
    return prod().stack.guards.network_policy.spec.apply(check)


@pulumi.runtime.test
def test_network_policy_admits_only_the_ingress_controller_and_prometheus(prod: Any) -> pulumi.Output[None]:
    def check(spec: Any) -> None:
        sources = sorted(
            (peer.namespace_selector.match_labels["kubernetes.io/metadata.name"], port.port)
            for rule in spec.ingress for peer in rule.from_ for port in rule.ports
        )
        assert sources == [("ingress-nginx", 8000), ("monitoring", 8000)]
        assert all(peer.ip_block is None and peer.pod_selector is None for rule in spec.ingress for peer in rule.from_)
    return prod().stack.guards.network_policy.spec.apply(check)


@pulumi.runtime.test
def test_each_slot_allows_one_voluntary_disruption_at_a_time(prod: Any) -> pulumi.Output[None]:
    budgets = prod().stack.guards.disruption_budgets
    assert sorted(budgets) == ["blue", "green"]

    def check(spec: Any) -> None:
        assert spec.max_unavailable == 1
        assert spec.min_available is None
        assert spec.unhealthy_pod_eviction_policy == "AlwaysAllow"
    return budgets["green"].spec.apply(check)


@pulumi.runtime.test
def test_disruption_budget_selects_the_slot_pods(prod: Any) -> pulumi.Output[None]:
    stack = prod().stack

    def check(budget: Any) -> pulumi.Output[None]:
        def same(deployment: Any) -> None:
            assert budget.selector.match_labels == deployment.selector.match_labels
        return stack.slots["blue"].deployment.spec.apply(same)
    return stack.guards.disruption_budgets["blue"].spec.apply(check)


@pulumi.runtime.test
def test_namespace_enforces_the_restricted_pod_security_level(prod: Any) -> pulumi.Output[None]:
    def check(metadata: Any) -> None:
        assert metadata.name == "specdeploy"
        assert metadata.labels["pod-security.kubernetes.io/enforce"] == "restricted"
    return prod().stack.namespace.namespace.metadata.apply(check)


@pulumi.runtime.test
def test_server_service_account_carries_no_api_token(prod: Any) -> pulumi.Output[None]:
    def check(automount: Any) -> None:
        assert automount is False
    return prod().stack.namespace.service_account.automount_service_account_token.apply(check)


@pulumi.runtime.test
def test_service_account_carries_the_workload_identity_annotation(prod: Any) -> pulumi.Output[None]:
    def check(metadata: Any) -> None:
        assert metadata.annotations == {
            "eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/specdeploy-k8s-prod-weights-reader"}
    return prod().stack.namespace.service_account.metadata.apply(check)


def test_host_path_cache_relaxes_enforcement_but_still_warns(render: Any, variant_config: Any) -> None:
    built = render("k8s-dev", variant_config("k8s-dev", kubernetes={"weight_cache": "hostPath"}))
    labels = built.one("Namespace", "specdeploy-dev")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
    assert labels["pod-security.kubernetes.io/warn"] == "restricted"
