"""Policies of the specdeploy pack, one function per rule, each with the rule it enforces.

Resource policies see one resource's properties; stack policies see all of them and
match companions by the identifiers AWS uses (a bucket's name, a load balancer's ARN).
Properties are the engine's camelCase names, as `pulumi preview` hands them over.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import re
from collections.abc import Mapping
from typing import Any

from pulumi_policy import (
    EnforcementLevel,
    Policy,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)

WORLD = ("0.0.0.0/0", "::/0")
# Ports the internet may reach: the load balancer's listeners. Everything else (the server port first) is not.
PUBLIC_PORTS = frozenset({80, 443})
BUCKET = "aws:s3/bucket:Bucket"
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
INSTANCE = "aws:ec2/instance:Instance"

# Shapes of credentials that must never sit in user-data in plain text.
SECRET_PATTERNS = {
    "an AWS access key id": re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),
    "an AWS secret access key": re.compile(r"aws_secret_access_key\s*[=:]\s*\S+", re.IGNORECASE),
    "a private key": re.compile(r"-----BEGIN (RSA |EC |OPENSSH )?PRIVATE KEY-----"),
    "an API key assignment": re.compile(
        r"(api[_-]?keys?|token|password|secret)\s*[=:]\s*['\"]?(?!/)[A-Za-z0-9_\-+=:.]{12,}", re.IGNORECASE),
}


def _ports_overlap(rule: Mapping[str, Any]) -> set[int] | None:
    """Ports a rule opens beyond the public ones; None when it opens none of them."""
    protocol = str(rule.get("protocol") or rule.get("ipProtocol") or "")
    low, high = int(rule.get("fromPort", 0) or 0), int(rule.get("toPort", 0) or 0)
    if protocol in ("-1", "all"):
        return {-1}
    extra = set(range(low, high + 1)) - PUBLIC_PORTS
    return extra or None


def no_world_open_ports(args: ResourceValidationArgs, report: ReportViolation) -> None:
    """Nothing but the load balancer's 80/443 may be reachable from 0.0.0.0/0 (the server port never)."""
    props = args.props
    if args.resource_type == "aws:ec2/securityGroup:SecurityGroup":
        rules = list(props.get("ingress") or [])
    elif args.resource_type in ("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule",
                                "aws:ec2/securityGroupRule:SecurityGroupRule"):
        if props.get("type", "ingress") != "ingress":
            return
        rules = [props]
    else:
        return
    for rule in rules:
        cidrs = list(rule.get("cidrBlocks") or []) + list(rule.get("ipv6CidrBlocks") or [])
        cidrs += [c for c in (rule.get("cidrIpv4"), rule.get("cidrIpv6")) if c]
        extra = _ports_overlap(rule)
        if extra and any(c in WORLD for c in cidrs):
            ports = "all ports" if extra == {-1} else f"ports {min(extra)}-{max(extra)}"
            report(f"{args.name}: ingress from the whole internet to {ports}; only the load balancer's "
                   "80/443 may be world-open, servers take traffic from the load balancer's security group", None)


def imds_v2_required(args: ResourceValidationArgs, report: ReportViolation) -> None:
    """Launch templates and instances require IMDSv2 session tokens."""
    if args.resource_type not in (LAUNCH_TEMPLATE, INSTANCE):
        return
    options = args.props.get("metadataOptions") or {}
    if options.get("httpTokens") != "required":
        report(f"{args.name}: metadataOptions.httpTokens must be 'required' (IMDSv2 only)", None)


def instances_not_public(args: ResourceValidationArgs, report: ReportViolation) -> None:
    """Serving instances get no public IP address."""
    if args.resource_type == LAUNCH_TEMPLATE:
        for interface in args.props.get("networkInterfaces") or []:
            if str(interface.get("associatePublicIpAddress", "false")).lower() == "true":
                report(f"{args.name}: network interface associates a public IP address", None)
    elif args.resource_type == INSTANCE and args.props.get("associatePublicIpAddress"):
        report(f"{args.name}: instance has a public IP address", None)


def _user_data(props: Mapping[str, Any]) -> str:
    raw = str(props.get("userData") or "")
    try:
        packed = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        return raw  # not base64: scan it as it is
    if packed[:2] == b"\x1f\x8b":  # gzip, as cloud-init accepts it
        try:
            packed = gzip.decompress(packed)
        except (OSError, EOFError):
            return raw
    return packed.decode("utf-8", errors="replace")


def no_secret_in_user_data(args: ResourceValidationArgs, report: ReportViolation) -> None:
    """User-data is readable by anyone with ec2:DescribeLaunchTemplateVersions: no credentials in it."""
    if args.resource_type not in (LAUNCH_TEMPLATE, INSTANCE):
        return
    text = _user_data(args.props)
    for what, pattern in SECRET_PATTERNS.items():
        if pattern.search(text):
            report(f"{args.name}: user-data contains {what}; read secrets from Secrets Manager at boot", None)


def alarms_have_runbook_and_action(args: ResourceValidationArgs, report: ReportViolation) -> None:
    """Every alarm notifies someone and links its runbook (runbooks/<AlarmName>.md)."""
    if args.resource_type != "aws:cloudwatch/metricAlarm:MetricAlarm":
        return
    if not args.props.get("alarmActions"):
        report(f"{args.name}: alarm has no alarmActions; nobody would be told", None)
    if not re.search(r"https?://\S+\.md\b", str(args.props.get("alarmDescription") or "")):
        report(f"{args.name}: alarmDescription does not link a runbook (<base>/<AlarmName>.md)", None)


def buckets_private_encrypted_versioned(args: StackValidationArgs, report: ReportViolation) -> None:
    """Every bucket blocks public access (all four settings), encrypts by default and keeps versions."""
    by_type: dict[str, list[Mapping[str, Any]]] = {}
    for resource in args.resources:
        by_type.setdefault(resource.resource_type, []).append(resource.props)

    def covered(type_token: str, bucket: str, ok: Any) -> bool:
        return any(p.get("bucket") == bucket and ok(p) for p in by_type.get(type_token, []))

    for resource in args.resources:
        if resource.resource_type != BUCKET:
            continue
        bucket = str(resource.props.get("bucket") or resource.props.get("id") or resource.name)
        if not covered("aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock", bucket, lambda p: all(
                p.get(k) is True for k in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls",
                                           "restrictPublicBuckets"))):
            report(f"bucket {bucket}: no public access block with all four settings on", resource.urn)
        if not covered("aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration",
                       bucket, lambda p: any(r.get("applyServerSideEncryptionByDefault", {}).get("sseAlgorithm")
                                             for r in p.get("rules") or [])):
            report(f"bucket {bucket}: no default encryption", resource.urn)
        if not covered("aws:s3/bucketVersioning:BucketVersioning", bucket,
                       lambda p: (p.get("versioningConfiguration") or {}).get("status") == "Enabled"):
            report(f"bucket {bucket}: versioning is not enabled", resource.urn)
        if resource.props.get("acl") in ("public-read", "public-read-write"):
            report(f"bucket {bucket}: public ACL {resource.props['acl']}", resource.urn)


def public_listeners_use_tls(args: StackValidationArgs, report: ReportViolation) -> None:
    """Listeners of an internet-facing load balancer serve HTTPS; plain HTTP only redirects to it."""
    public = {r.props.get("arn") for r in args.resources
              if r.resource_type == "aws:lb/loadBalancer:LoadBalancer" and r.props.get("internal") is False}
    for resource in args.resources:
        if resource.resource_type != "aws:lb/listener:Listener":
            continue
        props = resource.props
        if props.get("loadBalancerArn") not in public:
            continue
        if props.get("protocol") == "HTTPS":
            if not props.get("certificateArn") or not props.get("sslPolicy"):
                report(f"{resource.name}: HTTPS listener without certificate or TLS policy", resource.urn)
            continue
        actions = props.get("defaultActions") or []
        redirects = all(a.get("type") == "redirect" and (a.get("redirect") or {}).get("protocol") == "HTTPS"
                        for a in actions)
        if not actions or not redirects:
            report(f"{resource.name}: public {props.get('protocol')} listener on port {props.get('port')} serves "
                   "traffic without TLS; serve HTTPS or redirect to it", resource.urn)


# Server paths for operators and the load balancer only: metrics leak load and model details, /ready and
# /health let anyone watch a rollout.
INTERNAL_PATHS = frozenset({"/metrics", "/health", "/ready"})


def internal_paths_not_public(args: StackValidationArgs, report: ReportViolation) -> None:
    """A public load balancer's forwarding listeners answer /metrics, /health and /ready themselves
    (a listener rule with a fixed response) instead of forwarding them to the servers."""
    public = {r.props.get("arn") for r in args.resources
              if r.resource_type == "aws:lb/loadBalancer:LoadBalancer" and r.props.get("internal") is False}
    hidden: dict[str, set[str]] = {}
    for resource in args.resources:
        props = resource.props
        if resource.resource_type == "aws:lb/listenerRule:ListenerRule" and all(
                a.get("type") == "fixed-response" for a in props.get("actions") or [{}]):
            paths = {v for c in props.get("conditions") or [] for v in (c.get("pathPattern") or {}).get("values", [])}
            hidden.setdefault(props.get("listenerArn", ""), set()).update(paths)
    for resource in args.resources:
        props = resource.props
        if resource.resource_type != "aws:lb/listener:Listener" or props.get("loadBalancerArn") not in public:
            continue
        if not any(a.get("type") == "forward" for a in props.get("defaultActions") or []):
            continue
        exposed = sorted(INTERNAL_PATHS - hidden.get(props.get("arn", ""), set()))
        if exposed:
            report(f"{resource.name}: public listener forwards {', '.join(exposed)} to the servers; add a "
                   "listener rule answering them with a fixed response", resource.urn)


_MANDATORY = EnforcementLevel.MANDATORY

POLICIES: list[Policy] = [
    StackValidationPolicy(name="s3-buckets-private-encrypted-versioned", enforcement_level=_MANDATORY,
                          description=buckets_private_encrypted_versioned.__doc__ or "",
                          validate=buckets_private_encrypted_versioned),
    ResourceValidationPolicy(name="no-world-open-server-port", enforcement_level=_MANDATORY,
                             description=no_world_open_ports.__doc__ or "", validate=no_world_open_ports),
    StackValidationPolicy(name="tls-on-public-listeners", enforcement_level=_MANDATORY,
                          description=public_listeners_use_tls.__doc__ or "", validate=public_listeners_use_tls),
    StackValidationPolicy(name="internal-paths-not-public", enforcement_level=_MANDATORY,
                          description=internal_paths_not_public.__doc__ or "", validate=internal_paths_not_public),
    ResourceValidationPolicy(name="imdsv2-required", enforcement_level=_MANDATORY,
                             description=imds_v2_required.__doc__ or "", validate=imds_v2_required),
    ResourceValidationPolicy(name="alarms-have-runbook-and-action", enforcement_level=_MANDATORY,
                             description=alarms_have_runbook_and_action.__doc__ or "",
                             validate=alarms_have_runbook_and_action),
    ResourceValidationPolicy(name="instances-not-public", enforcement_level=_MANDATORY,
                             description=instances_not_public.__doc__ or "", validate=instances_not_public),
    ResourceValidationPolicy(name="no-plaintext-secret-in-user-data", enforcement_level=_MANDATORY,
                             description=no_secret_in_user_data.__doc__ or "", validate=no_secret_in_user_data),
]
