"""Queue-driven autoscaling: one HorizontalPodAutoscaler per slot on `specdeploy_requests_waiting`.

The metric reaches the HPA as a per-pod custom metric through the Prometheus
adapter (rule in docs/kubernetes.md). Scale-up reacts within a minute, one or two
pods at a time; scale-down waits out a long stabilisation window and removes one
pod per period, because a GPU pod that is wrongly removed costs minutes of weight
load to bring back. HPA rather than KEDA: docs/kubernetes.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s

from infra.components.kubernetes.common import quantity, slot_labels
from serving import metric_names


@dataclass(frozen=True)
class QueueAutoscalerArgs:
    namespace: pulumi.Input[str]
    deployments: dict[str, pulumi.Input[str]]  # slot name -> its Deployment name
    min_replicas: int  # per slot; at least 1 (scale to zero needs a feature gate managed clusters lack)
    max_replicas: int
    queue_target_per_pod: float  # average specdeploy_requests_waiting per pod the HPA aims for
    scale_down_stabilization_s: int

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"kubernetes.min_replicas ({self.min_replicas}) must lie in "
                             f"[1, kubernetes.max_replicas ({self.max_replicas})]")


class QueueAutoscaler(pulumi.ComponentResource):
    """An autoscaling/v2 HPA per slot Deployment, averaging waiting requests over the slot's pods."""

    autoscalers: dict[str, k8s.autoscaling.v2.HorizontalPodAutoscaler]

    def __init__(self, name: str, args: QueueAutoscalerArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("specdeploy:kubernetes:QueueAutoscaler", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)

        self.autoscalers = {}
        for slot, deployment in sorted(args.deployments.items()):
            self.autoscalers[slot] = k8s.autoscaling.v2.HorizontalPodAutoscaler(
                f"{name}-{slot}",
                metadata={"name": f"specdeploy-{slot}", "namespace": args.namespace, "labels": slot_labels(slot)},
                spec={
                    "scale_target_ref": {"api_version": "apps/v1", "kind": "Deployment", "name": deployment},
                    "min_replicas": args.min_replicas,
                    "max_replicas": args.max_replicas,
                    "metrics": [{
                        "type": "Pods",
                        "pods": {
                            "metric": {"name": metric_names.WAITING},
                            "target": {"type": "AverageValue", "average_value": quantity(args.queue_target_per_pod)},
                        },
                    }],
                    "behavior": {
                        "scale_up": {
                            "stabilization_window_seconds": 60,
                            "select_policy": "Max",
                            "policies": [{"type": "Pods", "value": 2, "period_seconds": 60}],
                        },
                        "scale_down": {
                            "stabilization_window_seconds": args.scale_down_stabilization_s,
                            "select_policy": "Min",
                            "policies": [{"type": "Pods", "value": 1, "period_seconds": 300}],
                        },
                    },
                },
                opts=child,
            )

        self.register_outputs({"slots": sorted(self.autoscalers)})
