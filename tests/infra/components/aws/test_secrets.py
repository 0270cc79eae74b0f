"""ApiKeySecret: the API keys reach Secrets Manager only as a Pulumi secret."""

from __future__ import annotations

from collections.abc import Callable

import pulumi
import pytest

from infra.components.aws.secrets import ApiKeySecret, ApiKeySecretArgs
from infra.config import PROJECT
from infra.program.preview import PreviewResult, new_mocks

StackFn = Callable[[str], PreviewResult]
VERSION = "aws:secretsmanager/secretVersion:SecretVersion"


@pytest.mark.parametrize("stack", ["dev", "staging", "prod"])
@pulumi.runtime.test
def test_secret_value_arrives_marked_secret(stack: str, aws_stack: StackFn) -> None:
    assert aws_stack(stack).single(VERSION).secret_paths == ("secretString",)


@pytest.mark.parametrize("stack", ["dev", "staging", "prod"])
@pulumi.runtime.test
def test_secret_name_is_a_per_stack_prefix_aws_completes(stack: str, aws_stack: StackFn) -> None:
    # A fixed name stays taken for the recovery window after a destroy; a prefix gets a fresh suffix each time.
    secret = aws_stack(stack).single("aws:secretsmanager/secret:Secret")
    assert secret.inputs["namePrefix"] == f"specdeploy/{stack}/api-keys-"
    assert "name" not in secret.inputs


@pulumi.runtime.test
def test_missing_keys_create_the_secret_without_a_value(aws_variant: Callable[..., PreviewResult]) -> None:
    result = aws_variant("dev", apiKeys=None)
    assert result.of_type("aws:secretsmanager/secret:Secret") and not result.of_type(VERSION)


def test_recovery_window_is_bounded() -> None:
    with pytest.raises(ValueError, match="recovery_window_days"):
        ApiKeySecretArgs(name_prefix="x-", api_keys=None, recovery_window_days=1)


_built: dict[str, ApiKeySecret] = {}


@pulumi.runtime.test
async def test_output_arn_is_not_secret_but_names_the_secret() -> None:
    if "secret" not in _built:
        pulumi.runtime.set_mocks(new_mocks(), project=PROJECT, stack="unit", preview=False)
        _built["secret"] = ApiKeySecret("api-keys", ApiKeySecretArgs(name_prefix="specdeploy/unit/api-keys-",
                                                                     api_keys="ops:key-123"))
    arn = _built["secret"].secret_arn
    assert not await arn.is_secret()
    assert await arn.future() == "arn:aws:secretsmanager:us-east-1:123456789012:api-keys-secret"
