"""Queue-driven HPA per slot: the server's waiting-request gauge, slow scale-down."""

from __future__ import annotations

from typing import Any

import pulumi

from serving import metric_names


def _hpa(prod: Any, slot: str = "blue") -> Any:
    return prod().stack.autoscaler.autoscalers[slot]


@pulumi.runtime.test
def test_each_slot_has_an_autoscaler_on_its_deployment(prod: Any) -> pulumi.Output[None]:
    autoscalers = prod().stack.autoscaler.autoscalers
    assert sorted(autoscalers) == ["blue", "green"]

    def check(specs: dict[str, Any]) -> None:  # Output.all hands the specs over as plain dicts
        refs = {slot: spec["scale_target_ref"] for slot, spec in specs.items()}
        assert {slot: (ref["api_version"], ref["kind"], ref["name"]) for slot, ref in refs.items()} == {
            "blue": ("apps/v1", "Deployment", "specdeploy-blue"),
            "green": ("apps/v1", "Deployment", "specdeploy-green"),
        }
    return pulumi.Output.all(**{slot: hpa.spec for slot, hpa in autoscalers.items()}).apply(check)


@pulumi.runtime.test
def test_scales_on_the_server_queue_length(prod: Any) -> pulumi.Output[None]:
    def check(spec: Any) -> None:
        [metric] = spec.metrics
        assert metric.type == "Pods"
        assert metric.pods.metric.name == metric_names.WAITING == "specdeploy_requests_waiting"
        assert (metric.pods.target.type, metric.pods.target.average_value) == ("AverageValue", "8")
    return _hpa(prod).spec.apply(check)


@pulumi.runtime.test
def test_replica_bounds_come_from_the_stack(prod: Any) -> pulumi.Output[None]:
    def check(spec: Any) -> None:
        assert (spec.min_replicas, spec.max_replicas) == (2, 8)
    return _hpa(prod).spec.apply(check)


@pulumi.runtime.test
def test_scale_down_is_stabilised_and_gradual(prod: Any) -> pulumi.Output[None]:
    def check(spec: Any) -> None:
        down = spec.behavior.scale_down
        assert down.stabilization_window_seconds == 600
        assert [(p.type, p.value, p.period_seconds) for p in down.policies] == [("Pods", 1, 300)]
    return _hpa(prod).spec.apply(check)


@pulumi.runtime.test
def test_dev_stack_uses_its_own_window(dev: Any) -> pulumi.Output[None]:
    def check(spec: Any) -> None:
        assert spec.behavior.scale_down.stabilization_window_seconds == 300
    return _hpa(dev).spec.apply(check)


def test_fractional_queue_target_is_a_milli_quantity(render: Any, variant_config: Any) -> None:
    built = render("k8s-dev", variant_config("k8s-dev", kubernetes={"queue_target_per_pod": 2.5}))
    target = built.one("HorizontalPodAutoscaler", "specdeploy-blue")["spec"]["metrics"][0]["pods"]["target"]
    assert target == {"type": "AverageValue", "averageValue": "2500m"}

