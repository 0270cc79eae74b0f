"""The `platform: aws` program: wires the AWS components from one StackConfig.

Called by :func:`infra.program.deploy`; returns the stack exports. Data shaping lives in
infra/program/aws_args.py, resource logic in infra/components/aws/. Every physical name
carries the stack, so dev, staging and prod share one account and region.
"""

from __future__ import annotations

import pulumi

from infra.capacity import plan
from infra.components.aws.alerting import Alerting
from infra.components.aws.gpu_fleet import GpuFleet
from infra.components.aws.image_repository import ImageRepository, ImageRepositoryArgs
from infra.components.aws.load_balancer import LoadBalancer
from infra.components.aws.model_store import ModelStore, ModelStoreArgs, split_s3_uri
from infra.components.aws.network import Network
from infra.components.aws.release_access import ReleaseOperatorPolicy, ReleaseOperatorPolicyArgs
from infra.components.aws.secrets import ApiKeySecret, ApiKeySecretArgs
from infra.config import SLOTS, StackConfig
from infra.program import aws_args


def deploy_aws(config: StackConfig, stack: str, region: str) -> dict[str, pulumi.Input[object]]:
    capacity = plan(config)
    pulumi.log.info(f"capacity plan:\n{capacity.render()}")
    bucket, _ = split_s3_uri(config.model.source)
    store = ModelStore("models", ModelStoreArgs(bucket_name=bucket))
    network = Network("net", aws_args.network(config, region))
    repository = aws_args.repository_name(config, stack)
    images = ImageRepository("images", ImageRepositoryArgs(repository_name=repository))
    api_keys = ApiKeySecret("api-keys", ApiKeySecretArgs(name_prefix=f"specdeploy/{stack}/api-keys-",
                                                         api_keys=config.api_keys))
    lb = LoadBalancer("lb", aws_args.load_balancer(config, network))
    missing = aws_args.missing_artifacts(config, region, repository)
    fleets: dict[str, GpuFleet] = {}
    for slot in SLOTS:
        spec = config.slots.slot(slot)
        if spec is not None:
            fleets[slot] = GpuFleet(f"fleet-{slot}", aws_args.fleet(
                config, stack, region, slot, spec, capacity, bootstrap=bool(missing.get(slot)),
                network=network, lb=lb, images=images, api_keys=api_keys,
            ), opts=pulumi.ResourceOptions(depends_on=[store]))
    alerting = Alerting("alerts", aws_args.alerting(config, stack, region, lb, fleets,
                                                    actions_enabled=not missing.get(config.slots.active)))
    release = ReleaseOperatorPolicy("release", ReleaseOperatorPolicyArgs(
        stack=stack, listener_arn=lb.listener_arn, alarm_arns=alerting.alarm_arns, bucket_name=store.bucket_name))
    return {
        "platform": "aws",
        "endpoint": lb.endpoint,
        "load_balancer_dns": lb.dns_name,  # point access.domain here (alias/CNAME)
        "model_bucket": store.bucket_name,
        "image_repository_url": images.repository_url,
        "api_key_secret_arn": api_keys.secret_arn,
        "listener_arn": lb.listener_arn,
        "target_group_arns": lb.target_group_arns,
        "gate_endpoints": lb.slot_endpoints,  # slot -> its slot listener; the output keeps its name (rollout reads it)
        "asg_names": {slot: f.asg_name for slot, f in fleets.items()},
        "alarm_names": alerting.alarm_names,
        "dashboard_name": alerting.dashboard_name,
        "release_policy_arn": release.policy_arn,  # attach to the role that runs specdeploy rollout/rollback
        "active_slot": config.slots.active,
        "canary_weight": config.slots.canary_weight,
        "instance_type": capacity.instance.name,
        "bootstrap_missing": {slot: reasons for slot, reasons in missing.items() if reasons},
    }
