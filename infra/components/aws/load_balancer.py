"""LoadBalancer: the ALB in front of the fleet, with blue and green target groups.

Internal by default. When the service is public it listens on HTTPS with the
stack's certificate (TLS 1.2+ policy) and HTTP only redirects. The listener
forwards by weight to the two slots' target groups, so a rollout or a rollback is
a weight change, no DNS and no cold start. Targets are checked on /ready (weights
verified, model loaded, warm, not draining), the idle timeout outlasts a long
generation, and deregistration waits as long as the server drains on SIGTERM.
Access logs go to their own private bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_aws as aws

from infra.components.aws.common import SecureBucket, child, secure_bucket, tags
from infra.config import SLOTS, load_balancer_idle_timeout_s, other_slot
from serving.config import SchedulerSection, ServiceSection

TLS_POLICY = "ELBSecurityPolicy-TLS13-1-2-2021-06"
READY_PATH = "/ready"
# Paths for operators and the load balancer, never for internet clients (an ALB condition takes at most 5 values).
INTERNAL_PATHS = ("/metrics", "/metrics/*", "/health", "/ready")
# One slot listener per slot: the release tooling (the launch validation, /ready, the shift guard's
# /metrics) reaches that slot alone through the load balancer, the only source the fleet's security
# group admits. The denial text is a live listener's input: it keeps its wording.
SLOT_LISTENER_PORTS = {"blue": 8081, "green": 8082}
SLOT_LISTENER_DENIED = "release gate path: source not in release.gate_cidrs"


@dataclass(frozen=True)
class LoadBalancerArgs:
    vpc_id: pulumi.Input[str]
    subnet_ids: pulumi.Input[list[str]]  # private subnets when internal, public subnets when public
    server_port: int
    active_slot: str
    canary_weight: int = 0  # percent of requests sent to the idle slot
    public: bool = False
    allowed_cidrs: list[str] = field(default_factory=lambda: ["10.0.0.0/8"])
    certificate_arn: str | None = None
    domain: str | None = None
    # the server's SIGTERM grace: deregistration waits this long
    drain_grace_s: float = ServiceSection.model_fields["drain_grace_s"].default
    # the server's own limit: the idle timeout must outlast it
    request_timeout_s: float = SchedulerSection.model_fields["request_timeout_s"].default
    access_log_days: int = 90
    gate_cidrs: list[str] = field(default_factory=list)  # release.gate_cidrs: sources the slot listeners admit

    def __post_init__(self) -> None:
        if self.active_slot not in SLOTS:
            raise ValueError(f"release.active: {self.active_slot!r} is not one of {', '.join(SLOTS)}")
        if not 0 <= self.canary_weight <= 100:
            raise ValueError(f"release.canary_weight: {self.canary_weight} is not a percentage")
        if len(self.gate_cidrs) > 4:  # a rule's conditions take at most 5 values, the port condition aside
            raise ValueError(f"release.gate_cidrs: {len(self.gate_cidrs)} blocks; a listener rule takes at most 4")

    @property
    def tls(self) -> bool:
        return self.certificate_arn is not None

    @property
    def idle_timeout_s(self) -> int:
        return load_balancer_idle_timeout_s(self.request_timeout_s)

    @property
    def deregistration_delay_s(self) -> int:
        return min(3600, math.ceil(self.drain_grace_s))

    def weights(self) -> dict[str, int]:
        return {self.active_slot: 100 - self.canary_weight, other_slot(self.active_slot): self.canary_weight}


class LoadBalancer(pulumi.ComponentResource):
    endpoint: pulumi.Output[str]
    dns_name: pulumi.Output[str]
    arn_suffix: pulumi.Output[str]
    security_group_id: pulumi.Output[str]
    listener_arn: pulumi.Output[str]
    log_bucket_name: pulumi.Output[str]
    target_group_arns: dict[str, pulumi.Output[str]]
    target_group_arn_suffixes: dict[str, pulumi.Output[str]]
    slot_endpoints: dict[str, pulumi.Output[str]]  # slot -> its slot listener's base URL (gate_cidrs only)

    def __init__(self, name: str, args: LoadBalancerArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("specdeploy:aws:LoadBalancer", name, None, opts)
        logs = self._log_bucket(name, args)
        sg = self._security_group(name, args)
        alb = self._alb(name, args, sg, logs)
        groups: dict[str, aws.lb.TargetGroup] = {slot: self._target_group(name, slot, args) for slot in SLOTS}
        listener = self._listeners(name, args, alb, groups)
        if args.public:
            self._hide_internal_paths(name, listener)
        slot_listeners = {slot: self._slot_listener(name, slot, args, alb, groups[slot])
                          for slot in SLOTS} if args.gate_cidrs else {}
        scheme = "https" if args.tls else "http"
        self.dns_name = alb.dns_name
        self.endpoint = pulumi.Output.concat(f"{scheme}://", args.domain or alb.dns_name)
        self.arn_suffix = alb.arn_suffix
        self.security_group_id = sg.id
        self.listener_arn = listener.arn
        self.log_bucket_name = logs.bucket.bucket
        self.target_group_arns = {slot: tg.arn for slot, tg in groups.items()}
        self.target_group_arn_suffixes = {slot: tg.arn_suffix for slot, tg in groups.items()}
        self.slot_endpoints = {slot: pulumi.Output.concat(self.endpoint, f":{SLOT_LISTENER_PORTS[slot]}")
                               for slot in slot_listeners}
        self.register_outputs({
            "slot_endpoints": self.slot_endpoints,
            "endpoint": self.endpoint,
            "dns_name": self.dns_name,
            "arn_suffix": self.arn_suffix,
            "security_group_id": self.security_group_id,
            "listener_arn": self.listener_arn,
            "log_bucket_name": self.log_bucket_name,
            "target_group_arns": self.target_group_arns,
        })

    def _security_group(self, name: str, args: LoadBalancerArgs) -> aws.ec2.SecurityGroup:
        listen_ports = [443, 80] if args.tls else [80]
        ingress: list[aws.ec2.SecurityGroupIngressArgsDict] = [
            {"protocol": "tcp", "from_port": port, "to_port": port, "cidr_blocks": list(args.allowed_cidrs),
             "description": "clients" if port != 80 or not args.tls else "clients (redirect to HTTPS)"}
            for port in listen_ports]
        if args.gate_cidrs:
            ingress += [{"protocol": "tcp", "from_port": port, "to_port": port, "cidr_blocks": list(args.gate_cidrs),
                         "description": f"release gates to the {slot} slot"}  # a live rule's text: kept
                        for slot, port in SLOT_LISTENER_PORTS.items()]
        return aws.ec2.SecurityGroup(
            f"{name}-sg",
            vpc_id=args.vpc_id,
            description=f"{'Public' if args.public else 'Internal'} ALB: clients on {listen_ports}",
            ingress=ingress,
            # Egress to the instances is added by each fleet, pointing at its own security group.
            tags=tags(f"{name}-sg"),
            opts=child(self),
        )

    def _alb(self, name: str, args: LoadBalancerArgs, sg: aws.ec2.SecurityGroup,
             logs: SecureBucket) -> aws.lb.LoadBalancer:
        return aws.lb.LoadBalancer(
            f"{name}-alb",
            load_balancer_type="application",
            internal=not args.public,
            subnets=args.subnet_ids,
            security_groups=[sg.id],
            idle_timeout=args.idle_timeout_s,
            drop_invalid_header_fields=True,
            enable_http2=True,
            access_logs={"bucket": logs.bucket.bucket, "prefix": "alb", "enabled": True},
            tags=tags(f"{name}-alb"),
            # The ALB checks at creation that it may write its logs: the bucket policy must exist first.
            opts=child(self, depends_on=[logs.policy]),
        )

    def _listeners(self, name: str, args: LoadBalancerArgs, alb: aws.lb.LoadBalancer,
                   groups: dict[str, aws.lb.TargetGroup]) -> aws.lb.Listener:
        """The listener that forwards by weight to the slots (HTTPS when TLS, with an HTTP redirect beside it)."""
        forward: aws.lb.ListenerDefaultActionArgsDict = {
            "type": "forward",
            "forward": {"target_groups": [{"arn": groups[slot].arn, "weight": weight}
                                          for slot, weight in sorted(args.weights().items())]},
        }
        # The release commands own the weights after creation (`specdeploy rollout|rollback` move them in one
        # ModifyListener call): a later `pulumi up`, refreshed or not, must not move traffic back to what an
        # older stack file says. `specdeploy release record` writes the live split into the stack file.
        owned = child(self, ignore_changes=["defaultActions"])
        if not args.tls:
            return aws.lb.Listener(f"{name}-http", load_balancer_arn=alb.arn, port=80, protocol="HTTP",
                                   default_actions=[forward], opts=owned)
        aws.lb.Listener(
            f"{name}-http-redirect", load_balancer_arn=alb.arn, port=80, protocol="HTTP",
            default_actions=[{"type": "redirect",
                              "redirect": {"protocol": "HTTPS", "port": "443", "status_code": "HTTP_301"}}],
            opts=child(self),
        )
        return aws.lb.Listener(
            f"{name}-https", load_balancer_arn=alb.arn, port=443, protocol="HTTPS", ssl_policy=TLS_POLICY,
            certificate_arn=args.certificate_arn, default_actions=[forward], opts=owned,
        )

    def _slot_listener(self, name: str, slot: str, args: LoadBalancerArgs, alb: aws.lb.LoadBalancer,
                       group: aws.lb.TargetGroup) -> aws.lb.Listener:
        """The slot listener: on SLOT_LISTENER_PORTS[slot], forwarding to that slot's target group alone, for
        sources in gate_cidrs (a rule; everyone else gets a fixed 403). The launch validation, /ready and the
        shift guard of `specdeploy rollout` go here instead of to the instances, which admit only the ALB.
        The resources keep their `-gate-` names: a new name would replace live listeners."""
        tls = {"protocol": "HTTPS", "ssl_policy": TLS_POLICY, "certificate_arn": args.certificate_arn} \
            if args.tls else {"protocol": "HTTP"}
        listener = aws.lb.Listener(
            f"{name}-gate-{slot}", load_balancer_arn=alb.arn, port=SLOT_LISTENER_PORTS[slot], **tls,
            default_actions=[{"type": "fixed-response",
                              "fixed_response": {"content_type": "text/plain", "message_body": SLOT_LISTENER_DENIED,
                                                 "status_code": "403"}}],
            tags=tags(f"{name}-gate-{slot}", slot=slot),
            opts=child(self),
        )
        aws.lb.ListenerRule(
            f"{name}-gate-{slot}-admit",
            listener_arn=listener.arn,
            priority=1,
            conditions=[{"source_ip": {"values": list(args.gate_cidrs)}}],
            actions=[{"type": "forward", "target_group_arn": group.arn}],
            tags=tags(f"{name}-gate-{slot}-admit", slot=slot),
            opts=child(self),
        )
        return listener

    def _hide_internal_paths(self, name: str, listener: aws.lb.Listener) -> aws.lb.ListenerRule:
        """Answer 404 for /metrics, /health and /ready from the internet; the ALB's own health checks go
        straight to the targets and never pass through a listener rule."""
        return aws.lb.ListenerRule(
            f"{name}-internal-paths",
            listener_arn=listener.arn,
            priority=1,
            conditions=[{"path_pattern": {"values": list(INTERNAL_PATHS)}}],
            actions=[{"type": "fixed-response",
                      "fixed_response": {"content_type": "text/plain", "message_body": "not found",
                                         "status_code": "404"}}],
            tags=tags(f"{name}-internal-paths"),
            opts=child(self),
        )

    def _target_group(self, name: str, slot: str, args: LoadBalancerArgs) -> aws.lb.TargetGroup:
        return aws.lb.TargetGroup(
            f"{name}-{slot}",
            vpc_id=args.vpc_id,
            port=args.server_port,
            protocol="HTTP",
            target_type="instance",
            # LLM requests vary from milliseconds to minutes: send each to the least busy server.
            load_balancing_algorithm_type="least_outstanding_requests",
            deregistration_delay=args.deregistration_delay_s,
            health_check={
                "enabled": True, "path": READY_PATH, "port": "traffic-port", "protocol": "HTTP", "matcher": "200",
                "interval": 15, "timeout": 5, "healthy_threshold": 2, "unhealthy_threshold": 3,
            },
            tags=tags(f"{name}-{slot}", slot=slot),
            opts=child(self),
        )

    def _log_bucket(self, name: str, args: LoadBalancerArgs) -> SecureBucket:
        # ALB log delivery writes as the region's ELB account (older regions) or the log-delivery service.
        elb_account = aws.elb.get_service_account_output(opts=pulumi.InvokeOutputOptions(parent=self))
        caller = aws.get_caller_identity_output(opts=pulumi.InvokeOutputOptions(parent=self))

        def delivery(values: list[Any]) -> list[dict[str, Any]]:
            elb_arn, account, bucket_arn = values
            resource = f"{bucket_arn}/alb/AWSLogs/{account}/*"
            return [
                {"Sid": "ElbAccountWritesLogs", "Effect": "Allow", "Principal": {"AWS": elb_arn},
                 "Action": "s3:PutObject", "Resource": resource},
                {"Sid": "LogDeliveryWritesLogs", "Effect": "Allow",
                 "Principal": {"Service": "logdelivery.elasticloadbalancing.amazonaws.com"},
                 "Action": "s3:PutObject", "Resource": resource},
            ]

        return secure_bucket(
            f"{name}-logs", self, bucket_name=None, sse_algorithm="AES256",  # ALB logs support SSE-S3 only
            noncurrent_days=7, expire_current_days=args.access_log_days,
            extra_statements=lambda arn: pulumi.Output.all(elb_account.arn, caller.account_id, arn).apply(delivery),
        )
