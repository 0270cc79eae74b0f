"""ReleaseOperatorPolicy: what `specdeploy rollout|rollback|release record|unlock` may do in this stack's
account, as one IAM managed policy the stack renders and exports (`release_policy_arn`).

Attach it to the role the deploy pipeline or the on-call operators assume. It grants exactly the calls the
release commands make, on this stack's resources only:

- the ALB listener: read it, and change its default action (the traffic split);
- the target groups' health (ELBv2 `Describe*` actions take no resource ARN: `*`, read-only);
- the stack's CloudWatch alarms: read their state (the shift guard) and switch their actions (paging follows
  traffic);
- the release lock object `release-lock/<stack>.json` (conditional writes: Get, Put and Delete) and new
  objects of the audit trail `release-audit/<stack>/` in the model bucket; `s3:ListBucket` on the bucket (key
  names only), which no command calls but without which S3 answers a read of the free lock with 403, not 404.

`tests/infra/ops/release/test_release_policy.py` records every AWS call a rollout, a rollback, a record and
an unlock make against moto and checks each against this document, and that the document grants nothing
they do not use.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_aws as aws

from infra.components.aws.common import child, tags

LOCK_PREFIX = "release-lock"  # infra/ops/release/lock.py and audit.py write here (tested to agree)
AUDIT_PREFIX = "release-audit"


def release_policy_document(stack: str, listener_arn: str, alarm_arns: list[str], bucket: str) -> dict[str, Any]:
    """The IAM policy document of the release commands for one stack."""
    objects = f"arn:aws:s3:::{bucket}"
    return {
        "Version": "2012-10-17",
        "Statement": [
            {"Sid": "ReadTraffic", "Effect": "Allow",
             "Action": ["elasticloadbalancing:DescribeListeners", "elasticloadbalancing:DescribeTargetHealth"],
             "Resource": "*"},  # ELBv2 Describe* actions support no resource-level permissions
            {"Sid": "ShiftTraffic", "Effect": "Allow", "Action": ["elasticloadbalancing:ModifyListener"],
             "Resource": [listener_arn]},
            {"Sid": "AlarmsFollowTraffic", "Effect": "Allow",
             "Action": ["cloudwatch:DescribeAlarms", "cloudwatch:EnableAlarmActions",
                        "cloudwatch:DisableAlarmActions"],
             "Resource": sorted(alarm_arns)},
            {"Sid": "ReleaseLock", "Effect": "Allow",
             "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
             "Resource": [f"{objects}/{LOCK_PREFIX}/{stack}.json"]},
            {"Sid": "AuditTrail", "Effect": "Allow", "Action": ["s3:PutObject"],
             "Resource": [f"{objects}/{AUDIT_PREFIX}/{stack}/*"]},
            # Never called, but S3 answers GetObject of a missing key with 403 AccessDenied instead of 404 unless
            # the caller may list the bucket: without it, a free lock would read as "access denied"
            {"Sid": "FreeLockReadsAsMissing", "Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": [objects]},
        ],
    }


@dataclass(frozen=True)
class ReleaseOperatorPolicyArgs:
    stack: str
    listener_arn: pulumi.Input[str]
    alarm_arns: pulumi.Input[list[str]]
    bucket_name: pulumi.Input[str]


class ReleaseOperatorPolicy(pulumi.ComponentResource):
    policy_arn: pulumi.Output[str]

    def __init__(self, name: str, args: ReleaseOperatorPolicyArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("specdeploy:aws:ReleaseOperatorPolicy", name, None, opts)
        document = pulumi.Output.all(args.listener_arn, args.alarm_arns, args.bucket_name).apply(
            lambda values: json.dumps(release_policy_document(args.stack, values[0], list(values[1]), values[2])))
        policy = aws.iam.Policy(
            f"{name}-policy",
            name=f"specdeploy-{args.stack}-release",  # IAM names are account-wide: the stack keeps it unique
            description=f"specdeploy rollout/rollback/release record/unlock for stack {args.stack}",
            policy=document,
            tags=tags(name),
            opts=child(self),
        )
        self.policy_arn = policy.arn
        self.register_outputs({"policy_arn": self.policy_arn})
