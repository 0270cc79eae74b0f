"""Entry point of the policy pack: `pulumi preview --policy-pack infra/policy`."""

from pulumi_policy import EnforcementLevel, PolicyPack

from infra.policy.aws_policies import POLICIES

PolicyPack(name="specdeploy-aws", enforcement_level=EnforcementLevel.MANDATORY, policies=POLICIES)
