"""The IAM policy the stack renders for the release commands admits every AWS call they make, and nothing
they do not use.

A rollout 10 → 50 → 100, a rollback, `release record`, and `unlock --force` of a stale lock run against
loopback moto with a botocore hook recording each call's operation and parameters. Each call is turned into
the IAM action and resource ARNs AWS authorizes it by, and evaluated against `release_policy_document` built
with moto's listener, alarms and bucket — the same function the stack's `ReleaseOperatorPolicy` renders.
(moto does not enforce IAM itself; this evaluation is the check.)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from infra.components.aws import release_access
from infra.components.aws.release_access import release_policy_document
from infra.config import StackFile
from infra.ops.cli.main import main
from infra.ops.release import audit, lock, validation
from infra.ops.release.lock import S3Lock, SharedLock, me
from infra.ops.release.validation import ValidationOutcome

from .conftest import MODEL_BUCKET, AwsRelease, SlotServer

FAST = ["--observe", "0.3s", "--poll", "0.1s"]
IAM_PREFIX = {"elastic-load-balancing-v2": "elasticloadbalancing", "cloudwatch": "cloudwatch", "s3": "s3"}
S3_ACTION = {"GetObject": "GetObject", "HeadObject": "GetObject", "PutObject": "PutObject",
             "DeleteObject": "DeleteObject", "ListObjectsV2": "ListBucket", "ListObjects": "ListBucket"}

Call = tuple[str, str, dict[str, Any]]  # service, operation, parameters


@pytest.fixture
def recorded() -> Iterator[list[Call]]:
    import boto3

    calls: list[Call] = []

    def hook(event_name: str, params: dict[str, Any], **_: Any) -> None:
        _, service, operation = event_name.split(".")
        calls.append((service, operation, dict(params)))

    session = boto3.DEFAULT_SESSION
    assert session is not None
    session.events.register("before-parameter-build", hook)
    yield calls
    session.events.unregister("before-parameter-build", hook)


def authorizations(call: Call, alarm_arns: dict[str, str]) -> list[tuple[str, str, dict[str, str]]]:
    """(IAM action, resource ARN, condition context) AWS checks for one call."""
    service, operation, params = call
    if service == "s3":
        action = f"s3:{S3_ACTION[operation]}"
        if operation.startswith("ListObjects"):
            return [(action, f"arn:aws:s3:::{params['Bucket']}", {"s3:prefix": params.get("Prefix", "")})]
        return [(action, f"arn:aws:s3:::{params['Bucket']}/{params['Key']}", {})]
    action = f"{IAM_PREFIX[service]}:{operation}"
    if operation == "ModifyListener":
        return [(action, params["ListenerArn"], {})]
    if service == "cloudwatch":
        names = params.get("AlarmNames")
        if not names:  # every alarm in the account: only a "*" resource would allow it
            return [(action, "*", {})]
        return [(action, alarm_arns[name], {}) for name in names]
    return [(action, "*", {})]  # ELBv2 Describe*: no resource-level permissions


def allowed(document: dict[str, Any], action: str, resource: str, context: dict[str, str]) -> bool:
    for statement in document["Statement"]:
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        resources = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
        if statement["Effect"] != "Allow" or action not in actions:
            continue
        if not any(fnmatch.fnmatchcase(resource, pattern) for pattern in resources):
            continue
        condition = statement.get("Condition", {}).get("StringLike", {})
        if all(any(fnmatch.fnmatchcase(context.get(k, ""), p) for p in patterns)
               for k, patterns in condition.items()):
            return True
    return False


def test_the_rendered_policy_admits_every_call_of_a_release_and_nothing_more(
        aws_release: AwsRelease, prod_copy: Path, slot_server: SlotServer, recorded: list[Call], s3: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import boto3

    def passed(stack: StackFile, endpoint: str, report_dir: Path) -> ValidationOutcome:
        return ValidationOutcome(True, "quick profile passed")

    monkeypatch.setattr(validation, "launch_validator", lambda hosts: passed)
    common = ["--stack", "prod", "--stacks-dir", str(prod_copy), "--state-dir", str(prod_copy.parent / "state")]
    assert main(["rollout", *common, "--to", "green", "--slot-endpoint", slot_server.url, *aws_release.cli_args(),
                 *FAST]) == 0
    assert main(["rollback", *common, *aws_release.cli_args()]) == 0
    assert main(["release", "record", *common, *aws_release.cli_args()]) == 0
    stale = replace(me("specdeploy rollout --stack prod --to green"), holder="alice@laptop", pid=4242)
    SharedLock(S3Lock(s3, MODEL_BUCKET, "prod"), stale, lambda *a, **k: None).acquire()
    assert main(["unlock", *common, "--force", "--reason", "laptop died mid-rollout"]) == 0
    calls = [c for c in recorded if c[0] in IAM_PREFIX]
    assert {c[1] for c in calls} >= {"ModifyListener", "EnableAlarmActions", "PutObject", "DeleteObject"}

    alarms = boto3.client("cloudwatch").describe_alarms(AlarmNames=aws_release.alarm_names)["MetricAlarms"]
    alarm_arns = {a["AlarmName"]: a["AlarmArn"] for a in alarms}
    document = release_policy_document("prod", aws_release.listener_arn, list(alarm_arns.values()), MODEL_BUCKET)

    denied = [(action, resource) for call in calls for action, resource, context in authorizations(call, alarm_arns)
              if not allowed(document, action, resource, context)]
    assert denied == []
    used = {action for call in calls for action, _, _ in authorizations(call, alarm_arns)}
    granted = {a for statement in document["Statement"] for a in statement["Action"]}
    # least privilege: nothing granted that a release did not use, except ListBucket, which makes S3 answer
    # the free lock's GetObject with 404 rather than 403 (AWS's rule for missing keys; moto always says 404)
    assert granted - used == {"s3:ListBucket"}
    assert used <= granted

    # and the grant is this stack's: another stack's lock, audit trail, listener or alarms are refused
    assert not allowed(document, "s3:PutObject", f"arn:aws:s3:::{MODEL_BUCKET}/release-lock/prod-eu.json", {})
    assert not allowed(document, "s3:PutObject", f"arn:aws:s3:::{MODEL_BUCKET}/release-audit/prod-eu/x.json", {})
    assert not allowed(document, "elasticloadbalancing:ModifyListener", aws_release.listener_arn + "x", {})
    assert not allowed(document, "cloudwatch:DisableAlarmActions",
                       next(iter(alarm_arns.values())).replace("prod-", "staging-"), {})


def test_the_policy_names_the_prefixes_the_release_commands_write() -> None:
    assert release_access.LOCK_PREFIX == lock.LOCK_PREFIX
    assert release_access.AUDIT_PREFIX == audit.AUDIT_PREFIX
