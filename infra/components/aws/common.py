"""Helpers shared by the AWS components: IAM documents, tags, and the one secure bucket recipe.

Not a component. The model store and the load balancer's access-log bucket both
need "private, encrypted, versioned, TLS only, old versions expire"; the recipe
lives here once so the two cannot drift apart (the policy pack checks both).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_aws as aws

# Namespace of the custom metrics the instances publish (CloudWatch agent and histogram publisher).
METRIC_NAMESPACE = "Specdeploy"
# The ASG dimension the metrics carry; the agent and the publisher both set it.
ASG_DIMENSION = "AutoScalingGroupName"


def child(parent: pulumi.Resource, **kwargs: Any) -> pulumi.ResourceOptions:
    """Options of a component's child: parented, so names and deletes follow the component."""
    return pulumi.ResourceOptions(parent=parent, **kwargs)


def tags(name: str, **extra: str) -> dict[str, str]:
    return {"Name": name, "app": "specdeploy", "managed-by": "pulumi", **extra}


def policy_document(statements: Sequence[dict[str, Any]]) -> str:
    return json.dumps({"Version": "2012-10-17", "Statement": list(statements)}, sort_keys=True)


def tls_only_statement(bucket_arn: str) -> dict[str, Any]:
    """Deny every request to the bucket that does not arrive over TLS."""
    return {
        "Sid": "DenyInsecureTransport",
        "Effect": "Deny",
        "Principal": "*",
        "Action": "s3:*",
        "Resource": [bucket_arn, f"{bucket_arn}/*"],
        "Condition": {"Bool": {"aws:SecureTransport": "false"}},
    }


@dataclass(frozen=True)
class SecureBucket:
    bucket: aws.s3.Bucket
    policy: aws.s3.BucketPolicy  # depend on it when a service checks its access at creation (ALB logs)


def secure_bucket(
    name: str,
    parent: pulumi.Resource,
    *,
    bucket_name: str | None,
    sse_algorithm: str,
    noncurrent_days: int,
    expire_current_days: int | None = None,
    extra_statements: Callable[[pulumi.Output[str]], pulumi.Input[list[dict[str, Any]]]] | None = None,
) -> SecureBucket:
    """A private, encrypted, versioned bucket with a TLS-only policy and lifecycle rules.

    `sse_algorithm` is ``aws:kms`` where the readers can use KMS, ``AES256`` where
    a service requires it (ALB access logs accept only SSE-S3). `extra_statements`
    builds further policy statements from the bucket's ARN.
    """
    bucket = aws.s3.Bucket(name, bucket=bucket_name, force_destroy=False, tags=tags(name), opts=child(parent))
    public_block = _block_public_access(name, parent, bucket)
    _encrypt(name, parent, bucket, sse_algorithm)
    _version_and_expire(name, parent, bucket, noncurrent_days, expire_current_days)
    policy = _tls_only_policy(name, parent, bucket, public_block, extra_statements)
    return SecureBucket(bucket, policy)


def _block_public_access(name: str, parent: pulumi.Resource, bucket: aws.s3.Bucket) -> aws.s3.BucketPublicAccessBlock:
    aws.s3.BucketOwnershipControls(
        f"{name}-ownership",
        bucket=bucket.id,
        rule={"object_ownership": "BucketOwnerEnforced"},  # ACLs off: the policy alone grants access
        opts=child(parent),
    )
    return aws.s3.BucketPublicAccessBlock(
        f"{name}-public-access",
        bucket=bucket.id,
        block_public_acls=True,
        block_public_policy=True,
        ignore_public_acls=True,
        restrict_public_buckets=True,
        opts=child(parent),
    )


def _encrypt(name: str, parent: pulumi.Resource, bucket: aws.s3.Bucket, sse_algorithm: str) -> None:
    aws.s3.BucketServerSideEncryptionConfiguration(
        f"{name}-encryption",
        bucket=bucket.id,
        rules=[{
            "apply_server_side_encryption_by_default": {"sse_algorithm": sse_algorithm},
            "bucket_key_enabled": sse_algorithm == "aws:kms",
        }],
        opts=child(parent),
    )


def _version_and_expire(name: str, parent: pulumi.Resource, bucket: aws.s3.Bucket, noncurrent_days: int,
                        expire_current_days: int | None) -> None:
    versioning = aws.s3.BucketVersioning(
        f"{name}-versioning",
        bucket=bucket.id,
        versioning_configuration={"status": "Enabled"},
        opts=child(parent),
    )
    rules: list[aws.s3.BucketLifecycleConfigurationRuleArgsDict] = [{
        "id": "expire-old-versions",
        "status": "Enabled",
        "filter": {},
        "noncurrent_version_expiration": {"noncurrent_days": noncurrent_days},
        "abort_incomplete_multipart_upload": {"days_after_initiation": 7},
    }]
    if expire_current_days:
        rules.append({"id": "expire-objects", "status": "Enabled", "filter": {},
                      "expiration": {"days": expire_current_days}})
    aws.s3.BucketLifecycleConfiguration(
        f"{name}-lifecycle", bucket=bucket.id, rules=rules, opts=child(parent, depends_on=[versioning])
    )


def _tls_only_policy(
    name: str,
    parent: pulumi.Resource,
    bucket: aws.s3.Bucket,
    public_block: aws.s3.BucketPublicAccessBlock,
    extra_statements: Callable[[pulumi.Output[str]], pulumi.Input[list[dict[str, Any]]]] | None,
) -> aws.s3.BucketPolicy:
    extra = extra_statements(bucket.arn) if extra_statements else []
    statements = pulumi.Output.all(bucket.arn, extra).apply(
        lambda args: policy_document([tls_only_statement(args[0]), *args[1]])
    )
    return aws.s3.BucketPolicy(
        f"{name}-policy",
        bucket=bucket.id,
        policy=statements,
        # A policy put before the public access block exists could briefly allow too much.
        opts=child(parent, depends_on=[public_block]),
    )
