"""Data shaping for the AWS program: component arguments from one StackConfig.

Each function turns stack settings (and outputs of components already built) into
one component's args, so infra/program/aws.py reads as wiring only.
"""

from __future__ import annotations

from infra.alerts import alert_rules
from infra.capacity import CapacityPlan, weight_cache_gib
from infra.components.aws.alerting import AlertingArgs
from infra.components.aws.gpu_fleet import GpuFleet, GpuFleetArgs
from infra.components.aws.image_repository import ImageRepository
from infra.components.aws.load_balancer import LoadBalancer, LoadBalancerArgs
from infra.components.aws.model_store import split_s3_uri
from infra.components.aws.network import Network, NetworkArgs
from infra.components.aws.release_artifacts import ImageRef, live_missing_artifacts
from infra.components.aws.secrets import ApiKeySecret
from infra.components.aws.user_data import SECRETS_DIR, UserDataSpec
from infra.config import MODEL_CACHE_DIR, SLOTS, SlotSpec, StackConfig, render_server_config


def repository_name(config: StackConfig, stack: str) -> str:
    """The stack's ECR repository: one per stack, so several stacks share an account and region."""
    return config.fleet.image_repository or f"specdeploy-{stack}"


def check_slot_images(config: StackConfig, repository: str) -> None:
    """Each slot's image must live in the stack's repository: the instance role may pull only from there."""
    for slot in SLOTS:
        spec = config.slots.slot(slot)
        if spec is not None and ImageRef.parse(spec.image).repository != repository:
            raise ValueError(f"release.{slot}.image {spec.image!r} is not in this stack's repository "
                             f"{repository!r}: push it there (`specdeploy image push --stack ...`)")


def missing_artifacts(config: StackConfig, region: str, repository: str) -> dict[str, list[str]]:
    """slot -> what it still lacks (image digest, weight manifests); a slot lacking anything starts at zero."""
    check_slot_images(config, repository)
    missing: dict[str, list[str]] = {}
    for slot in SLOTS:
        spec = config.slots.slot(slot)
        if spec is not None:
            uris = [uri for uri in (spec.model_version, spec.draft_version) if uri]
            missing[slot] = live_missing_artifacts(region, spec.image, uris)
    return missing


def network(config: StackConfig, region: str) -> NetworkArgs:
    access = config.access
    return NetworkArgs(region=region, public=access.public, vpc_id=access.vpc_id,
                       private_subnet_ids=access.private_subnet_ids, public_subnet_ids=access.public_subnet_ids)


def load_balancer(config: StackConfig, net: Network) -> LoadBalancerArgs:
    access, release = config.access, config.slots
    return LoadBalancerArgs(
        vpc_id=net.vpc_id, subnet_ids=net.public_subnet_ids if access.public else net.private_subnet_ids,
        server_port=config.service.port, active_slot=release.active, canary_weight=release.canary_weight,
        public=access.public, allowed_cidrs=access.allowed_cidrs, certificate_arn=access.certificate_arn,
        domain=access.domain, drain_grace_s=config.service.drain_grace_s,
        request_timeout_s=config.scheduler.request_timeout_s, gate_cidrs=slot_listener_cidrs(config),
    )


def slot_listener_cidrs(config: StackConfig) -> list[str]:
    """Sources the slot listeners admit: release.gate_cidrs, else the clients of an internal load balancer;
    a public one opens no slot listener unless release.gate_cidrs names the operators' networks."""
    if config.slots.gate_cidrs is not None:
        return list(config.slots.gate_cidrs)
    return [] if config.access.public else list(config.access.allowed_cidrs)


def boot(config: StackConfig, stack: str, region: str, slot: str, spec: SlotSpec) -> UserDataSpec:
    """What one slot's instances run at boot (the secret is addressed by ARN once it exists)."""
    server_logs, metric_logs = UserDataSpec.log_groups(stack, slot)
    return UserDataSpec(
        stack=stack, slot=slot, region=region, image=spec.image,
        model_uri=spec.model_version, draft_uri=spec.draft_version,
        model_dir=f"{MODEL_CACHE_DIR}/target", draft_dir=f"{MODEL_CACHE_DIR}/draft" if spec.draft_version else None,
        cache_dir=MODEL_CACHE_DIR,
        # the slot's own server settings (release.<slot>.server) over the stack's: a change on the idle slot
        # rewrites only its launch template
        server_config_yaml=render_server_config(config.for_slot(slot),
                                                api_keys_file=f"{SECRETS_DIR}/api_keys").to_yaml(),
        secret_id=f"specdeploy/{stack}/api-keys", log_group=server_logs, prometheus_log_group=metric_logs,
        port=config.service.port, drain_grace_s=config.service.drain_grace_s, ready_timeout_s=config.fleet.warmup_s,
        driver_min=config.fleet.nvidia_driver_min, metrics_require_auth=config.service.metrics_require_auth,
    )


def fleet(config: StackConfig, stack: str, region: str, slot: str, spec: SlotSpec, capacity: CapacityPlan, *,
          bootstrap: bool, network: Network, lb: LoadBalancer, images: ImageRepository,
          api_keys: ApiKeySecret) -> GpuFleetArgs:
    bucket, _ = split_s3_uri(config.model.source)
    return GpuFleetArgs(
        boot=boot(config, stack, region, slot, spec), bucket_name=bucket, instance_type=capacity.instance.name,
        fleet=config.fleet, weight_cache_gb=weight_cache_gib(capacity.estimate), vpc_id=network.vpc_id,
        subnet_ids=network.private_subnet_ids, lb_security_group_id=lb.security_group_id,
        target_group_arn=lb.target_group_arns[slot], repository_arn=images.repository_arn,
        secret_arn=api_keys.secret_arn, spot_alternatives=capacity.same_gpu_alternatives(3), bootstrap=bootstrap,
        ami_id=spec.ami, carries_traffic=config.slots.carries_traffic(slot),
    )


def alerting(config: StackConfig, stack: str, region: str, lb: LoadBalancer, fleets: dict[str, GpuFleet], *,
             actions_enabled: bool) -> AlertingArgs:
    return AlertingArgs(
        stack=stack, region=region, rules=alert_rules(config), runbook_base_url=config.alerting.runbook_base_url,
        weights=config.slots.weights(), alb_arn_suffix=lb.arn_suffix,
        target_group_arn_suffixes=dict(lb.target_group_arn_suffixes),
        asg_names={slot: f.asg_name for slot, f in fleets.items()},
        emails=config.alerting.emails, https_endpoints=config.alerting.https_endpoints,
        actions_enabled=actions_enabled,
    )
