"""The Kubernetes components take narrow Args, like the AWS ones: never the whole stack config."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

import pytest

import infra.components.kubernetes as package
from infra.components.kubernetes.autoscaling import QueueAutoscalerArgs
from infra.components.kubernetes.gateway_routing import GatewayRoutingArgs
from infra.components.kubernetes.routing import TrafficSplit


def _args_classes() -> list[type]:
    found = []
    for module in pkgutil.iter_modules(package.__path__):
        loaded = importlib.import_module(f"{package.__name__}.{module.name}")
        found += [value for name, value in vars(loaded).items()
                  if name.endswith("Args") and dataclasses.is_dataclass(value) and value.__module__ == loaded.__name__]
    return found


def test_every_component_has_an_args_class() -> None:
    names = {cls.__name__ for cls in _args_classes()}
    assert names == {"QueueAutoscalerArgs", "GatewayRoutingArgs", "ServingNamespaceArgs", "ServingObservabilityArgs",
                     "ReleaseSlotArgs", "WeightedRoutingArgs", "ServingGuardsArgs", "ReleaseOperatorRoleArgs"}


@pytest.mark.parametrize("args_class", _args_classes(), ids=lambda cls: cls.__name__)
def test_no_args_field_is_the_whole_stack_config(args_class: type) -> None:
    wide = [f.name for f in dataclasses.fields(args_class) if "StackConfig" in str(f.type)]
    assert wide == []


def test_gateway_routing_names_the_missing_gateway() -> None:
    with pytest.raises(ValueError, match=r"kubernetes\.gateway"):
        GatewayRoutingArgs(namespace="specdeploy", split=TrafficSplit("specdeploy-blue", None, 0), gateway=None,
                           host=None, port=8000, request_timeout_s=60)


@pytest.mark.parametrize(("low", "high"), [(0, 4), (5, 4)])
def test_autoscaler_refuses_replicas_outside_one_to_max(low: int, high: int) -> None:
    with pytest.raises(ValueError, match=r"kubernetes\.min_replicas"):
        QueueAutoscalerArgs(namespace="specdeploy", deployments={"blue": "specdeploy-blue"}, min_replicas=low,
                            max_replicas=high, queue_target_per_pod=8, scale_down_stabilization_s=600)
