"""The Pulumi program: `pulumi up --stack <env>` with stacks/Pulumi.<env>.yaml.

Only wiring: read the stack config once, hand it to the platform's program
(:mod:`infra.program.aws` or :mod:`infra.program.kubernetes`), export what operators
and the release tooling read. ``infra/__main__.py`` (Pulumi.yaml ``main: infra/``)
calls :func:`run`.
"""

from __future__ import annotations

import pulumi

from infra.config import StackConfig, from_pulumi


def deploy(config: StackConfig) -> dict[str, pulumi.Input[object]]:
    """Build the stack for its platform; returns the exports."""
    if config.platform == "local":
        raise RuntimeError("platform 'local' has no Pulumi program: `specdeploy up --stack local` is the local path")
    if config.platform == "kubernetes":
        from infra.program.kubernetes import deploy_kubernetes

        return dict(deploy_kubernetes(config))
    from infra.program.aws import deploy_aws

    region = pulumi.Config("aws").get("region")
    if not region:
        raise RuntimeError("aws:region is not set in the stack file")
    return deploy_aws(config, pulumi.get_stack(), region)


def run() -> dict[str, pulumi.Input[object]]:
    """The program's entry: read the stack through Pulumi, deploy, export; returns the exports."""
    exports = deploy(from_pulumi())
    for key, value in sorted(exports.items()):
        pulumi.export(key, value)
    return exports
