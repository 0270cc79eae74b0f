"""Missing artifacts: does what a release slot runs exist yet (image digest in ECR, manifest.json in S3)?

The first `pulumi up` in an empty account creates the repository and the model bucket
itself, so nothing can have been pushed yet. Instances started then would fail
`docker pull` or the weight pull and be replaced in a loop while alarms page. The
program asks this module first and keeps the slot's fleet at zero instances (alarm
actions off) until both artifacts exist; the next `pulumi up` after
`specdeploy image push` and `specdeploy weights push` brings the fleet up.

Uses boto3 with the same credentials and region as the Pulumi AWS provider. Under
Pulumi's mocks (offline preview, tests) there is no account to ask: the check reports
nothing missing, so previews show the full fleet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infra.components.aws.model_store import split_s3_uri

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class ImageRef:
    registry: str  # <account>.dkr.ecr.<region>.amazonaws.com
    repository: str
    digest: str  # sha256:<64 hex>

    @classmethod
    def parse(cls, image: str) -> ImageRef:
        if "@" not in image or "/" not in image:
            raise ValueError(f"{image!r} is not <registry>/<repository>@sha256:<digest>")
        name, digest = image.split("@", 1)
        registry, repository = name.split("/", 1)
        return cls(registry, repository, digest)


def _error_code(exc: Exception) -> str:
    response: dict[str, Any] = getattr(exc, "response", {}) or {}
    return str(response.get("Error", {}).get("Code", ""))


def missing_image(ecr: Any, image: str) -> str | None:
    """Why the image cannot be pulled yet, or None when ECR holds that digest."""
    ref = ImageRef.parse(image)
    try:
        ecr.describe_images(repositoryName=ref.repository, imageIds=[{"imageDigest": ref.digest}])
    except Exception as exc:  # botocore ClientError; code names the cause
        code = _error_code(exc)
        if code in ("RepositoryNotFoundException", "ImageNotFoundException"):
            return f"image {ref.repository}@{ref.digest} is not in ECR ({code})"
        raise
    return None


def missing_manifest(s3: Any, uri: str) -> str | None:
    """Why the weights at `uri` cannot be pulled yet, or None when its manifest.json exists."""
    bucket, prefix = split_s3_uri(uri)
    key = f"{prefix}/{MANIFEST}" if prefix else MANIFEST
    try:
        s3.head_object(Bucket=bucket, Key=key)
    except Exception as exc:
        code = _error_code(exc)
        if code in ("404", "NoSuchKey", "NoSuchBucket", "NotFound"):
            return f"weights manifest s3://{bucket}/{key} does not exist"
        raise
    return None


def missing_artifacts(ecr: Any, s3: Any, image: str, weight_uris: list[str]) -> list[str]:
    """Everything a slot needs that is not there yet; empty when its instances can start."""
    found = [missing_image(ecr, image), *[missing_manifest(s3, uri) for uri in weight_uris]]
    return [reason for reason in found if reason]


def under_mocks() -> bool:
    """True inside Pulumi's mocks engine (offline preview, unit tests): no account to ask."""
    from pulumi.runtime import settings
    from pulumi.runtime.mocks import MockMonitor

    return isinstance(settings.SETTINGS.monitor, MockMonitor)


def live_missing_artifacts(region: str, image: str, weight_uris: list[str]) -> list[str]:
    """The check as the program runs it: boto3 against the stack's account, nothing under mocks."""
    if under_mocks():
        return []
    import boto3

    return missing_artifacts(boto3.client("ecr", region_name=region), boto3.client("s3", region_name=region),
                             image, weight_uris)
