"""Blue/green releases: traffic shifting under a shift guard, automatic rollback, and the stack file.

``specdeploy rollout`` / ``specdeploy rollback`` (``infra.ops.cli.release_cmd``) drive
:mod:`infra.ops.release.rollout`; the platform-specific parts sit behind two small
interfaces (:class:`~infra.ops.release.traffic.TrafficRouter` and the guard's alarm sources)
so the orchestration is the same for an ALB listener and an ingress-nginx canary.
Nothing here is imported at CLI start: boto3 is imported only by ``aws``.
"""
