"""ModelStore: the S3 bucket holding model versions (directory + manifest.json per version).

Secure by default: public access blocked, SSE-KMS, versioning (a bad push can be
undone), noncurrent versions expire, and a bucket policy that refuses plain HTTP.
Readers get access through their own IAM roles, scoped to the prefixes they serve.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlparse

import pulumi

from infra.components.aws.common import secure_bucket

_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class ModelStoreArgs:
    bucket_name: str  # physical name; the stack's weight URIs point into it
    noncurrent_version_days: int = 30  # how long an overwritten or deleted object stays recoverable

    def __post_init__(self) -> None:
        if not _BUCKET_NAME.match(self.bucket_name):
            raise ValueError(f"model.source: {self.bucket_name!r} is not a valid S3 bucket name")
        if self.noncurrent_version_days < 1:
            raise ValueError("model store noncurrent_version_days must be at least 1")


def split_s3_uri(uri: str) -> tuple[str, str]:
    """(bucket, prefix without slashes) of an s3:// weights URI."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3":
        raise ValueError(f"{uri!r} is not an s3:// URI; the AWS platform serves weights from S3")
    return parsed.netloc, parsed.path.strip("/")


class ModelStore(pulumi.ComponentResource):
    bucket_name: pulumi.Output[str]
    bucket_arn: pulumi.Output[str]

    def __init__(self, name: str, args: ModelStoreArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("specdeploy:aws:ModelStore", name, None, opts)
        bucket = secure_bucket(
            f"{name}-bucket", self, bucket_name=args.bucket_name, sse_algorithm="aws:kms",
            noncurrent_days=args.noncurrent_version_days,
        ).bucket
        self.bucket_name = bucket.bucket
        self.bucket_arn = bucket.arn
        self.register_outputs({"bucket_name": self.bucket_name, "bucket_arn": self.bucket_arn})
