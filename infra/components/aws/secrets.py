"""ApiKeySecret: the server's API keys in Secrets Manager.

The value comes from the stack's Pulumi secret (`specdeploy:apiKeys`) and stays
marked secret through every output. Instances read it at boot with their role
into a root-only file the server mounts; it never appears in user-data, in the
launch template, or in logs.

The name is a prefix plus a random suffix AWS appends (`name_prefix`): a deleted secret
keeps its name for the recovery window, so a fixed name would make a destroy and
re-create within that window fail with "scheduled for deletion". Instances address
the secret by ARN.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra.components.aws.common import child, tags


@dataclass(frozen=True)
class ApiKeySecretArgs:
    name_prefix: str  # e.g. specdeploy/prod/api-keys-; AWS appends a unique suffix
    api_keys: pulumi.Input[str] | None  # `id:key[:rpm]`, comma separated; None: the operator puts the value
    recovery_window_days: int = 7

    def __post_init__(self) -> None:
        if not 7 <= self.recovery_window_days <= 30:
            raise ValueError("api key secret recovery_window_days must lie in [7, 30]")


class ApiKeySecret(pulumi.ComponentResource):
    secret_arn: pulumi.Output[str]
    secret_name: pulumi.Output[str]

    def __init__(self, name: str, args: ApiKeySecretArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("specdeploy:aws:ApiKeySecret", name, None, opts)
        secret = aws.secretsmanager.Secret(
            f"{name}-secret",
            name_prefix=args.name_prefix,
            description="specdeploy server API keys (id:key[:rpm], comma separated); read by instances at boot",
            recovery_window_in_days=args.recovery_window_days,
            tags=tags(args.name_prefix.rstrip("-")),
            opts=child(self),
        )
        if args.api_keys is None:
            pulumi.log.warn(f"{name}: specdeploy:apiKeys is not set; put the keys with "
                            "`aws secretsmanager put-secret-value` before instances boot", resource=self)
        else:
            aws.secretsmanager.SecretVersion(
                f"{name}-version",
                secret_id=secret.id,
                # Output.secret: encrypted in the state, masked in previews and diffs.
                secret_string=pulumi.Output.secret(args.api_keys),
                opts=child(self),
            )
        self.secret_arn = secret.arn
        self.secret_name = secret.name
        self.register_outputs({"secret_arn": self.secret_arn, "secret_name": self.secret_name})
