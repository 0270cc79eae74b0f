"""ImageRepository: immutable tags, scan on push, untagged images expire."""

from __future__ import annotations

import json
from collections.abc import Callable

import pulumi
import pytest

from infra.components.aws.image_repository import ImageRepository, ImageRepositoryArgs
from infra.config import PROJECT
from infra.program.preview import PreviewResult, new_mocks

StackFn = Callable[[str], PreviewResult]
REPO = "aws:ecr/repository:Repository"


@pytest.mark.parametrize("stack", ["dev", "staging", "prod"])
@pulumi.runtime.test
def test_tags_are_immutable(stack: str, aws_stack: StackFn) -> None:
    assert aws_stack(stack).single(REPO).inputs["imageTagMutability"] == "IMMUTABLE"


@pytest.mark.parametrize("stack", ["dev", "staging", "prod"])
@pulumi.runtime.test
def test_images_are_scanned_on_push(stack: str, aws_stack: StackFn) -> None:
    assert aws_stack(stack).single(REPO).inputs["imageScanningConfiguration"] == {"scanOnPush": True}


@pulumi.runtime.test
def test_repository_is_named_by_the_fleet_setting(aws_variant: Callable[..., PreviewResult]) -> None:
    image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/team-llm/server@sha256:" + "3" * 64
    uri = "s3://acme-specdeploy-models-prod/llama-3.1-8b-instruct/2026-11-28"
    result = aws_variant("prod", fleet={"image_repository": "team-llm/server"},  # not the default
                         release={"active": "blue", "blue": {
                             "image": image, "model_version": uri,
                             "draft_version": "s3://acme-specdeploy-models-prod/llama-3.2-1b-instruct/2026-11-28"}})
    assert result.single(REPO).inputs["name"] == "team-llm/server"
    assert result.exports["image_repository_url"].endswith("/team-llm/server")


@pulumi.runtime.test
def test_untagged_images_expire(aws_stack: StackFn) -> None:
    rules = json.loads(aws_stack("prod").single("aws:ecr/lifecyclePolicy:LifecyclePolicy").inputs["policy"])["rules"]
    assert rules[0]["selection"]["tagStatus"] == "untagged" and rules[0]["action"]["type"] == "expire"



_built: dict[str, ImageRepository] = {}


@pulumi.runtime.test
def test_output_url_points_at_the_repository() -> pulumi.Output[None]:
    if "repo" not in _built:
        pulumi.runtime.set_mocks(new_mocks(), project=PROJECT, stack="unit", preview=False)
        _built["repo"] = ImageRepository("images", ImageRepositoryArgs(repository_name="specdeploy-server"))

    def check(url: str) -> None:
        assert url.endswith(".dkr.ecr.us-east-1.amazonaws.com/specdeploy-server")

    return _built["repo"].repository_url.apply(check)
