"""ImageRepository: the ECR repository the server image is pushed to and pulled from.

Tags are immutable (a tag can never be moved to other bits), images are scanned
on push, and untagged images expire. Instances run the image by digest from the
release slot, so what was validated is exactly what serves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra.components.aws.common import child, tags


@dataclass(frozen=True)
class ImageRepositoryArgs:
    repository_name: str
    untagged_expire_days: int = 14


class ImageRepository(pulumi.ComponentResource):
    repository_url: pulumi.Output[str]
    repository_arn: pulumi.Output[str]

    def __init__(self, name: str, args: ImageRepositoryArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("specdeploy:aws:ImageRepository", name, None, opts)
        repo = aws.ecr.Repository(
            f"{name}-repo",
            name=args.repository_name,
            image_tag_mutability="IMMUTABLE",
            image_scanning_configuration={"scan_on_push": True},
            encryption_configurations=[{"encryption_type": "KMS"}],
            tags=tags(args.repository_name),
            opts=child(self),
        )
        aws.ecr.LifecyclePolicy(
            f"{name}-lifecycle",
            repository=repo.name,
            policy=json.dumps({"rules": [{
                "rulePriority": 1,
                "description": "Expire untagged images (tagged releases are kept for rollback)",
                "selection": {"tagStatus": "untagged", "countType": "sinceImagePushed",
                              "countUnit": "days", "countNumber": args.untagged_expire_days},
                "action": {"type": "expire"},
            }]}),
            opts=child(self),
        )
        self.repository_url = repo.repository_url
        self.repository_arn = repo.arn
        self.register_outputs({"repository_url": self.repository_url, "repository_arn": self.repository_arn})
