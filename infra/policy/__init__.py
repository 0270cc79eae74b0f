"""The specdeploy policy pack (pulumi-policy / CrossGuard).

Policies live in :mod:`infra.policy.aws_policies` so tests and the offline preview can
call them; ``__main__.py`` only constructs the pack (which starts a gRPC server and
blocks), as `pulumi preview --policy-pack infra/policy` expects.
"""
