"""ModelStore: private, encrypted, versioned, TLS-only bucket with lifecycle, in every AWS stack."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pulumi
import pytest

from infra.components.aws.model_store import ModelStore, ModelStoreArgs, split_s3_uri
from infra.config import PROJECT, load_stack
from infra.program.preview import PreviewResult, new_mocks

STACKS = ("dev", "staging", "prod")
StackFn = Callable[[str], PreviewResult]


def _child(result: PreviewResult, suffix: str) -> dict[str, Any]:
    found = [r for r in result.resources if r.name == f"models-bucket-{suffix}"]
    assert len(found) == 1, suffix
    return found[0].inputs


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_bucket_is_the_one_the_weight_uris_point_into(stack: str, aws_stack: StackFn) -> None:
    bucket = aws_stack(stack).one("aws:s3/bucket:Bucket", "models-bucket").inputs["bucket"]
    assert bucket == split_s3_uri(load_stack(stack).config.model.source)[0]


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_public_access_is_blocked_in_all_four_ways(stack: str, aws_stack: StackFn) -> None:
    block = _child(aws_stack(stack), "public-access")
    assert [block[k] for k in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls",
                               "restrictPublicBuckets")] == [True] * 4


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_objects_are_encrypted_with_kms(stack: str, aws_stack: StackFn) -> None:
    rule = _child(aws_stack(stack), "encryption")["rules"][0]
    assert rule["applyServerSideEncryptionByDefault"]["sseAlgorithm"] == "aws:kms"


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_versioning_is_enabled(stack: str, aws_stack: StackFn) -> None:
    assert _child(aws_stack(stack), "versioning")["versioningConfiguration"]["status"] == "Enabled"


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_old_versions_expire(stack: str, aws_stack: StackFn) -> None:
    rules = _child(aws_stack(stack), "lifecycle")["rules"]
    assert any(r.get("noncurrentVersionExpiration", {}).get("noncurrentDays", 0) > 0 for r in rules)


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_policy_denies_requests_without_tls(stack: str, aws_stack: StackFn) -> None:
    statements = json.loads(_child(aws_stack(stack), "policy")["policy"])["Statement"]
    deny = [s for s in statements if s["Effect"] == "Deny"]
    assert deny and deny[0]["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_acls_are_disabled(stack: str, aws_stack: StackFn) -> None:
    assert _child(aws_stack(stack), "ownership")["rule"]["objectOwnership"] == "BucketOwnerEnforced"


def test_invalid_bucket_name_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"model\.source: 'Bad_Bucket'"):
        ModelStoreArgs(bucket_name="Bad_Bucket")


def test_only_s3_uris_are_served_on_aws() -> None:
    with pytest.raises(ValueError, match="not an s3:// URI"):
        split_s3_uri("file:///data/models")


# --- outputs, inside the Pulumi runtime -------------------------------------------------------

_built: dict[str, ModelStore] = {}


def _store() -> ModelStore:
    if "store" not in _built:
        pulumi.runtime.set_mocks(new_mocks(), project=PROJECT, stack="unit", preview=False)
        _built["store"] = ModelStore("models", ModelStoreArgs(bucket_name="acme-models"))
    return _built["store"]


@pulumi.runtime.test
def test_output_bucket_name_is_the_physical_name() -> pulumi.Output[None]:
    def check(name: str) -> None:
        assert name == "acme-models"

    return _store().bucket_name.apply(check)


@pulumi.runtime.test
def test_output_bucket_arn_is_an_s3_arn() -> pulumi.Output[None]:
    def check(arn: str) -> None:
        assert arn == "arn:aws:s3:::acme-models"

    return _store().bucket_arn.apply(check)
