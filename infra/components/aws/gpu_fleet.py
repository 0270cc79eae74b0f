"""GpuFleet: the instances of one release slot (blue or green) and how they scale.

A launch template (GPU AMI, IMDSv2 only, no public address, encrypted gp3 root
sized for the weight cache, user-data from infra/components/aws/user_data.py), an instance role
that can read only this slot's model prefixes, pull the server image, read the
API-key secret and publish metrics and logs, and an autoscaling group behind the
slot's target group with ELB health checks and a grace period covering weight
pull, load and warm-up. Scaling tracks the server's waiting requests per instance
(`specdeploy_requests_waiting`, published by the CloudWatch agent), never below
the baseline `fleet.min_size`; schedules raise the baseline for known peaks.

Instances join the target group only once they are ready: a launch lifecycle hook
holds each new instance in Pending:Wait until its user-data sees `/ready` and
completes the hook (or abandons it on a failed boot), so a booting instance is never
an unhealthy target and normal scale-outs, refreshes and blue/green bring-ups page
nobody. The autoscaler owns the running size: Pulumi sets `desired_capacity` at
creation and ignores it afterwards. During bootstrap (image or weights not pushed
yet) the group is created at zero instances.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import pulumi
import pulumi_aws as aws

from infra.components.aws.common import ASG_DIMENSION, METRIC_NAMESPACE, child, policy_document, tags
from infra.components.aws.model_store import split_s3_uri
from infra.components.aws.user_data import LAUNCH_HOOK, UserDataSpec, encode_user_data, render_user_data
from infra.config import FleetSpec
from serving import metric_names as m

_DIGEST = re.compile(r"^[^\s@]+@sha256:[0-9a-f]{64}$")
# Image, OS, docker layers and logs on the root volume besides the weight cache.
ROOT_VOLUME_BASE_GB = 60
SSM_CORE_POLICY = "arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore"


@dataclass(frozen=True)
class GpuFleetArgs:
    boot: UserDataSpec  # what the instances run: stack, slot, image, weight URIs, server config, log groups
    bucket_name: str  # the model store; the slot's URIs must point into it
    instance_type: str  # from the capacity plan
    fleet: FleetSpec
    weight_cache_gb: int  # disk the weight cache needs (capacity plan)
    vpc_id: pulumi.Input[str]
    subnet_ids: pulumi.Input[list[str]]  # private subnets
    lb_security_group_id: pulumi.Input[str]
    target_group_arn: pulumi.Input[str]
    repository_arn: pulumi.Input[str]
    secret_arn: pulumi.Input[str]
    spot_alternatives: list[str] = field(default_factory=list)  # other types that fit, for spot pools
    log_retention_days: int = 30
    bootstrap: bool = False  # image or weights not pushed yet: the group exists with zero instances
    ami_id: str | None = None  # release.<slot>.ami, pinned by the slot; else fleet.ami_id, else SSM
    carries_traffic: bool = True  # the stack file gives this slot a share of traffic

    @property
    def launch_hook_timeout_s(self) -> int:
        # Pending:Wait lasts until user-data completes the hook after /ready; past this the launch is abandoned.
        return self.fleet.warmup_s + 300

    @property
    def slot(self) -> str:
        return self.boot.slot

    @property
    def stack(self) -> str:
        return self.boot.stack

    @property
    def server_port(self) -> int:
        return self.boot.port

    def __post_init__(self) -> None:
        where = f"release.{self.slot}"
        if not _DIGEST.match(self.boot.image):
            raise ValueError(f"{where}.image must pin a digest (<repository>@sha256:<64 hex>), "
                             f"got {self.boot.image!r}")
        for key, uri in (("model_version", self.boot.model_uri), ("draft_version", self.boot.draft_uri)):
            if uri is None:
                continue
            bucket, prefix = split_s3_uri(uri)
            if bucket != self.bucket_name or not prefix:
                raise ValueError(f"{where}.{key}: {uri} is not a version inside the model store "
                                 f"s3://{self.bucket_name}/")
        need = self.weight_cache_gb + ROOT_VOLUME_BASE_GB
        if self.fleet.root_volume_gb < need:
            raise ValueError(f"fleet.root_volume_gb ({self.fleet.root_volume_gb}) is below {need} GiB: "
                             f"{self.weight_cache_gb} GiB weight cache + {ROOT_VOLUME_BASE_GB} GiB image and OS")

    @property
    def model_prefixes(self) -> list[str]:
        return [split_s3_uri(uri)[1] for uri in (self.boot.model_uri, self.boot.draft_uri) if uri]


class GpuFleet(pulumi.ComponentResource):
    asg_name: pulumi.Output[str]
    role_arn: pulumi.Output[str]
    security_group_id: pulumi.Output[str]
    launch_template_id: pulumi.Output[str]

    def __init__(self, name: str, args: GpuFleetArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("specdeploy:aws:GpuFleet", name, None, opts)
        log_groups = [
            aws.cloudwatch.LogGroup(f"{name}-{kind}-logs", name=group, retention_in_days=args.log_retention_days,
                                    tags=tags(group, slot=args.slot), opts=child(self))
            for kind, group in (("server", args.boot.log_group), ("metrics", args.boot.prometheus_log_group))
        ]
        role, profile = self._role(name, args, [group.arn for group in log_groups])
        sg = self._security_group(name, args)
        template = self._launch_template(name, args, profile, sg)
        asg = self._group(name, args, template)
        self._scaling(name, args, asg)
        self.asg_name = asg.name
        self.role_arn = role.arn
        self.security_group_id = sg.id
        self.launch_template_id = template.id
        self.register_outputs({
            "asg_name": self.asg_name,
            "role_arn": self.role_arn,
            "security_group_id": self.security_group_id,
            "launch_template_id": self.launch_template_id,
        })

    def _role(self, name: str, args: GpuFleetArgs,
              log_group_arns: list[pulumi.Output[str]]) -> tuple[aws.iam.Role, aws.iam.InstanceProfile]:
        role = aws.iam.Role(
            f"{name}-role",
            assume_role_policy=policy_document([{
                "Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole",
            }]),
            description=f"specdeploy {args.stack}/{args.slot} serving instances",
            tags=tags(f"{name}-role", slot=args.slot),
            opts=child(self),
        )
        bucket_arn = f"arn:aws:s3:::{args.bucket_name}"
        prefixes = args.model_prefixes

        def document(values: list[object]) -> str:
            repository_arn, secret_arn, log_group_arns = values
            assert isinstance(log_group_arns, list)
            return policy_document([
                {"Sid": "ReadModelVersions", "Effect": "Allow", "Action": "s3:GetObject",
                 "Resource": [f"{bucket_arn}/{prefix}/*" for prefix in prefixes]},
                {"Sid": "ListModelVersions", "Effect": "Allow", "Action": "s3:ListBucket", "Resource": bucket_arn,
                 "Condition": {"StringLike": {"s3:prefix": [p for x in prefixes for p in (x, f"{x}/*")]}}},
                {"Sid": "EcrLogin", "Effect": "Allow", "Action": "ecr:GetAuthorizationToken", "Resource": "*"},
                {"Sid": "PullServerImage", "Effect": "Allow", "Resource": repository_arn,
                 "Action": ["ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer", "ecr:BatchCheckLayerAvailability"]},
                {"Sid": "ReadApiKeys", "Effect": "Allow", "Action": "secretsmanager:GetSecretValue",
                 "Resource": secret_arn},
                {"Sid": "PublishMetrics", "Effect": "Allow", "Action": "cloudwatch:PutMetricData", "Resource": "*",
                 "Condition": {"StringEquals": {"cloudwatch:namespace": METRIC_NAMESPACE}}},
                {"Sid": "WriteLogs", "Effect": "Allow",
                 "Action": ["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"],
                 "Resource": [arn for group in log_group_arns for arn in (group, f"{group}:*")]},
                {"Sid": "CompleteLaunchHook", "Effect": "Allow", "Action": "autoscaling:CompleteLifecycleAction",
                 "Resource": "*", "Condition": {"StringEquals": {"autoscaling:ResourceTag/stack": args.stack,
                                                                 "autoscaling:ResourceTag/slot": args.slot}}},
            ])

        aws.iam.RolePolicy(
            f"{name}-policy",
            role=role.id,
            policy=pulumi.Output.all(args.repository_arn, args.secret_arn, pulumi.Output.all(*log_group_arns)).apply(
                document),
            opts=child(self),
        )
        # Session Manager instead of SSH: no key pairs, no port 22.
        aws.iam.RolePolicyAttachment(f"{name}-ssm", role=role.name, policy_arn=SSM_CORE_POLICY, opts=child(self))
        profile = aws.iam.InstanceProfile(f"{name}-profile", role=role.name, opts=child(self))
        return role, profile

    def _security_group(self, name: str, args: GpuFleetArgs) -> aws.ec2.SecurityGroup:
        sg = aws.ec2.SecurityGroup(
            f"{name}-sg",
            vpc_id=args.vpc_id,
            description=f"specdeploy {args.slot} servers: port {args.server_port} from the load balancer only",
            egress=[{"protocol": "tcp", "from_port": 443, "to_port": 443, "cidr_blocks": ["0.0.0.0/0"],
                     "description": "HTTPS to AWS service endpoints"}],
            tags=tags(f"{name}-sg", slot=args.slot),
            opts=child(self),
        )
        aws.vpc.SecurityGroupIngressRule(
            f"{name}-from-lb", security_group_id=sg.id, referenced_security_group_id=args.lb_security_group_id,
            ip_protocol="tcp", from_port=args.server_port, to_port=args.server_port,
            description="server port from the load balancer", opts=child(self),
        )
        aws.vpc.SecurityGroupEgressRule(
            f"{name}-lb-to-fleet", security_group_id=args.lb_security_group_id, referenced_security_group_id=sg.id,
            ip_protocol="tcp", from_port=args.server_port, to_port=args.server_port,
            description=f"load balancer to the {args.slot} servers", opts=child(self),
        )
        return sg

    def _launch_template(self, name: str, args: GpuFleetArgs, profile: aws.iam.InstanceProfile,
                         sg: aws.ec2.SecurityGroup) -> aws.ec2.LaunchTemplate:
        fleet = args.fleet
        pinned = args.ami_id or fleet.ami_id
        keep: list[str] = []
        if pinned:
            image_id: pulumi.Input[str] = pinned
        else:
            # Resolved at `pulumi up` and pinned in the template: a new AMI shows up as a reviewed diff.
            # An AMI id is public: `insecure_value` keeps it readable (`value` is always marked secret).
            image_id = aws.ssm.get_parameter_output(
                name=fleet.ami_ssm_parameter, opts=pulumi.InvokeOutputOptions(parent=self)).insecure_value
            if args.carries_traffic:
                # A new AMI in SSM lands on the idle slot only and reaches traffic through a rollout: the
                # template of a slot carrying traffic keeps the AMI it was created with.
                keep = ["imageId"]
        instance_tags = tags(f"{name}-server", slot=args.slot, stack=args.stack)
        return aws.ec2.LaunchTemplate(
            f"{name}-lt",
            image_id=image_id,
            instance_type=args.instance_type,
            iam_instance_profile={"arn": profile.arn},
            metadata_options={
                "http_endpoint": "enabled",
                "http_tokens": "required",  # IMDSv2 only
                "http_put_response_hop_limit": 1,  # containers on the bridge network cannot reach IMDS
                "instance_metadata_tags": "enabled",  # the boot script reads its ASG name from tags
            },
            network_interfaces=[{
                "associate_public_ip_address": "false",
                "security_groups": [sg.id],
                "delete_on_termination": "true",
            }],
            block_device_mappings=[{
                "device_name": "/dev/sda1",
                "ebs": {"volume_size": fleet.root_volume_gb, "volume_type": "gp3", "encrypted": "true",
                        "iops": 6000, "throughput": 500,  # the weight cache loads at disk speed
                        "delete_on_termination": "true"},
            }],
            monitoring={"enabled": True},
            # The secret's ARN (its name carries a random suffix) is known once the secret exists.
            user_data=pulumi.Output.from_input(args.secret_arn).apply(
                lambda arn: encode_user_data(render_user_data(replace(args.boot, secret_id=arn)))),
            update_default_version=True,
            tag_specifications=[{"resource_type": "instance", "tags": instance_tags},
                                {"resource_type": "volume", "tags": instance_tags}],
            tags=tags(f"{name}-lt", slot=args.slot),
            opts=child(self, ignore_changes=keep),
        )

    def _group(self, name: str, args: GpuFleetArgs, template: aws.ec2.LaunchTemplate) -> aws.autoscaling.Group:
        fleet = args.fleet
        version = template.latest_version.apply(str)
        spec: aws.autoscaling.GroupLaunchTemplateArgsDict = {"id": template.id, "version": version}
        mixed: aws.autoscaling.GroupMixedInstancesPolicyArgsDict | None = None
        if fleet.capacity_type != "on-demand":
            base = 0 if fleet.capacity_type == "spot" else fleet.on_demand_base
            mixed = {
                "instances_distribution": {
                    "on_demand_base_capacity": base,
                    "on_demand_percentage_above_base_capacity": 0,
                    "spot_allocation_strategy": "price-capacity-optimized",
                },
                "launch_template": {
                    "launch_template_specification": {"launch_template_id": template.id, "version": version},
                    "overrides": [{"instance_type": t} for t in [args.instance_type, *args.spot_alternatives]],
                },
            }
        warmup = fleet.warmup_s
        metric = aws.autoscaling.Metric
        refresh: aws.autoscaling.GroupInstanceRefreshArgsDict = {
            "strategy": "Rolling",
            # Launch before terminating: capacity never dips during a refresh.
            "preferences": {"min_healthy_percentage": 100, "max_healthy_percentage": 200,
                            "instance_warmup": str(warmup)},
        }
        group_tags: list[aws.autoscaling.GroupTagArgsDict] = [
            {"key": k, "value": v, "propagate_at_launch": True}
            for k, v in sorted(tags(f"{name}-server", slot=args.slot, stack=args.stack).items())
        ]
        min_size, max_size, desired = fleet_sizes(args)
        return aws.autoscaling.Group(
            f"{name}-asg",
            vpc_zone_identifiers=args.subnet_ids,
            min_size=min_size,
            max_size=max_size,
            desired_capacity=desired,
            launch_template=None if mixed else spec,
            mixed_instances_policy=mixed,
            capacity_rebalance=fleet.capacity_type != "on-demand",
            target_group_arns=[args.target_group_arn],
            health_check_type="ELB",
            health_check_grace_period=warmup,  # weight pull + load + warm-up before /ready can pass
            default_instance_warmup=warmup,
            wait_for_capacity_timeout=f"{warmup + 600}s",
            enabled_metrics=[metric.GROUP_DESIRED_CAPACITY, metric.GROUP_IN_SERVICE_INSTANCES,
                             metric.GROUP_PENDING_INSTANCES, metric.GROUP_MIN_SIZE, metric.GROUP_MAX_SIZE],
            instance_refresh=refresh,
            initial_lifecycle_hooks=[{
                "name": LAUNCH_HOOK,
                "lifecycle_transition": "autoscaling:EC2_INSTANCE_LAUNCHING",
                "heartbeat_timeout": args.launch_hook_timeout_s,
                "default_result": "ABANDON",  # a boot that never completes the hook is replaced, never served
            }],
            tags=group_tags,
            # Target tracking and schedules own the running size: `pulumi up --refresh` must not reset it.
            opts=child(self, ignore_changes=["desiredCapacity"]),
        )

    def _scaling(self, name: str, args: GpuFleetArgs, asg: aws.autoscaling.Group) -> None:
        fleet = args.fleet
        aws.autoscaling.Policy(
            f"{name}-queue-tracking",
            autoscaling_group_name=asg.name,
            policy_type="TargetTrackingScaling",
            estimated_instance_warmup=fleet.warmup_s,
            target_tracking_configuration={
                "target_value": fleet.queue_target_per_instance,
                "customized_metric_specification": {
                    "metric_name": m.WAITING,
                    "namespace": METRIC_NAMESPACE,
                    "statistic": "Average",  # the group average = waiting requests per instance
                    "metric_dimensions": [{"name": ASG_DIMENSION, "value": asg.name}],
                },
            },
            opts=child(self),
        )
        for schedule in [] if args.bootstrap else fleet.scale_schedules:
            aws.autoscaling.Schedule(
                f"{name}-{schedule.name}",
                autoscaling_group_name=asg.name,
                scheduled_action_name=schedule.name,
                recurrence=schedule.cron,
                time_zone="Etc/UTC",
                min_size=schedule.min_size,
                max_size=fleet.max_size,
                opts=child(self),
            )


def fleet_sizes(args: GpuFleetArgs) -> tuple[int, int, int]:
    """(min, max, desired) of the group: all zero while bootstrapping, so no instance starts without its image."""
    fleet = args.fleet
    if args.bootstrap:
        return 0, 0, 0
    desired = fleet.desired_capacity if fleet.desired_capacity is not None else fleet.min_size
    return fleet.min_size, fleet.max_size, desired
