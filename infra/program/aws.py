"""The `platform: aws` program: wires the AWS components from one StackConfig.

Called by :func:`infra.program.deploy`; returns the stack exports instead of exporting
them, so the caller decides and tests can read them. Resource logic lives in
infra/components/aws/.
"""

from __future__ import annotations

import pulumi

from infra.alerts import alert_rules
from infra.capacity import plan, weight_cache_gib
from infra.components.aws.alerting import Alerting, AlertingArgs
from infra.components.aws.gpu_fleet import GpuFleet, GpuFleetArgs
from infra.components.aws.image_repository import ImageRepository, ImageRepositoryArgs
from infra.components.aws.load_balancer import LoadBalancer, LoadBalancerArgs
from infra.components.aws.model_store import ModelStore, ModelStoreArgs, split_s3_uri
from infra.components.aws.network import Network, NetworkArgs
from infra.components.aws.secrets import ApiKeySecret, ApiKeySecretArgs
from infra.components.aws.user_data import SECRETS_DIR, UserDataSpec
from infra.config import MODEL_CACHE_DIR, SLOTS, StackConfig, render_server_config


def deploy_aws(config: StackConfig, stack: str, region: str) -> dict[str, pulumi.Input[object]]:
    capacity = plan(config)
    pulumi.log.info(f"capacity plan:\n{capacity.render()}")
    release, access, fleet = config.slots, config.access, config.fleet
    bucket, _ = split_s3_uri(config.model.source)

    store = ModelStore("models", ModelStoreArgs(bucket_name=bucket))
    network = Network("net", NetworkArgs(region=region, public=access.public, vpc_id=access.vpc_id,
                                         private_subnet_ids=access.private_subnet_ids,
                                         public_subnet_ids=access.public_subnet_ids))
    images = ImageRepository("images", ImageRepositoryArgs(repository_name=fleet.image_repository))
    secret_name = f"specdeploy/{stack}/api-keys"
    api_keys = ApiKeySecret("api-keys", ApiKeySecretArgs(secret_name=secret_name, api_keys=config.api_keys))
    lb = LoadBalancer("lb", LoadBalancerArgs(
        vpc_id=network.vpc_id,
        subnet_ids=network.public_subnet_ids if access.public else network.private_subnet_ids,
        server_port=config.service.port, active_slot=release.active, canary_weight=release.canary_weight,
        public=access.public, allowed_cidrs=access.allowed_cidrs, certificate_arn=access.certificate_arn,
        domain=access.domain, drain_grace_s=config.service.drain_grace_s,
        request_timeout_s=config.scheduler.request_timeout_s,
    ))
    server_config = render_server_config(config, api_keys_file=f"{SECRETS_DIR}/api_keys").to_yaml()
    fleets: dict[str, GpuFleet] = {}
    for slot in SLOTS:
        spec = release.slot(slot)
        if spec is None:
            continue
        server_logs, metric_logs = UserDataSpec.log_groups(stack, slot)
        boot = UserDataSpec(
            stack=stack, slot=slot, region=region, image=spec.image,
            model_uri=spec.model_version, draft_uri=spec.draft_version,
            model_dir=f"{MODEL_CACHE_DIR}/target", draft_dir=f"{MODEL_CACHE_DIR}/draft" if spec.draft_version else None,
            cache_dir=MODEL_CACHE_DIR, server_config_yaml=server_config, secret_id=secret_name,
            log_group=server_logs, prometheus_log_group=metric_logs, port=config.service.port,
            drain_grace_s=config.service.drain_grace_s, ready_timeout_s=fleet.warmup_s,
            driver_min=fleet.nvidia_driver_min, metrics_require_auth=config.service.metrics_require_auth,
        )
        fleets[slot] = GpuFleet(f"fleet-{slot}", GpuFleetArgs(
            boot=boot, bucket_name=bucket, instance_type=capacity.instance.name, fleet=fleet,
            weight_cache_gb=weight_cache_gib(capacity.estimate), vpc_id=network.vpc_id,
            subnet_ids=network.private_subnet_ids, lb_security_group_id=lb.security_group_id,
            target_group_arn=lb.target_group_arns[slot], repository_arn=images.repository_arn,
            secret_arn=api_keys.secret_arn, spot_alternatives=capacity.same_gpu_alternatives(3),
        ), opts=pulumi.ResourceOptions(depends_on=[store]))
    alerting = Alerting("alerts", AlertingArgs(
        stack=stack, region=region, rules=alert_rules(config), runbook_base_url=config.alerting.runbook_base_url,
        active_slot=release.active, alb_arn_suffix=lb.arn_suffix,
        target_group_arn_suffixes=dict(lb.target_group_arn_suffixes),
        asg_names={slot: f.asg_name for slot, f in fleets.items()},
        emails=config.alerting.emails, https_endpoints=config.alerting.https_endpoints,
    ))
    return {
        "platform": "aws",
        "endpoint": lb.endpoint,
        "load_balancer_dns": lb.dns_name,  # point access.domain here (alias/CNAME)
        "model_bucket": store.bucket_name,
        "image_repository_url": images.repository_url,
        "api_key_secret_arn": api_keys.secret_arn,
        "listener_arn": lb.listener_arn,
        "target_group_arns": lb.target_group_arns,
        "asg_names": {slot: f.asg_name for slot, f in fleets.items()},
        "alarm_names": alerting.alarm_names,
        "dashboard_name": alerting.dashboard_name,
        "active_slot": release.active,
        "canary_weight": release.canary_weight,
        "instance_type": capacity.instance.name,
    }
