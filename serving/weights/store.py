"""Where model versions live: ``file://`` directories and ``s3://`` buckets (any S3-compatible store).

A store is addressed by URI; keys are the manifest's POSIX paths below it. Reads of missing
objects raise ``WeightsError`` naming the key.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlparse

from serving.weights.manifest import ProgressFn, WeightsError

_CHUNK = 1 << 20
MULTIPART_CHUNK_BYTES = 8 << 20
TRANSFER_THREADS_PER_FILE = 4


class ObjectStore(Protocol):
    uri: str

    def get_bytes(self, key: str) -> bytes: ...

    def put_bytes(self, key: str, data: bytes) -> None: ...

    def upload(self, local: Path, key: str, progress: ProgressFn | None = None) -> None: ...

    def download(self, key: str, local: Path, progress: ProgressFn | None = None) -> None: ...


def open_store(uri: str, endpoint_url: str | None = None) -> ObjectStore:
    """Open ``file:///abs/dir``, ``file://relative/dir`` or ``s3://bucket/prefix``.

    ``endpoint_url`` (else ``$AWS_ENDPOINT_URL``) points s3:// at any S3-compatible store.
    """
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        # file:///abs/dir is absolute; file://rel/dir (as in stacks/Pulumi.local.yaml) is
        # relative to the working directory.
        host = "" if parsed.netloc == "localhost" else parsed.netloc
        return FileStore(Path(unquote(host + parsed.path)).absolute(), uri)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise WeightsError(f"{uri}: no bucket in s3:// URI")
        return S3Store(parsed.netloc, parsed.path.strip("/"), uri, endpoint_url)
    raise WeightsError(f"{uri}: unsupported store URI (use s3://bucket/prefix or file:///path)")


# Weights are read by the server, which may run as another uid than the one that pushed or pulled them
# (the image's user 10001, a root `specdeploy up`): readable by all, writable by the owner, whatever the umask.
FILE_MODE = 0o644
DIR_MODE = 0o755


def _copy(src: Path, dst: Path, progress: ProgressFn | None) -> None:
    with src.open("rb") as fin, dst.open("wb") as fout:
        while chunk := fin.read(_CHUNK):
            fout.write(chunk)
            if progress is not None:
                progress(len(chunk))


class FileStore:
    def __init__(self, root: Path, uri: str) -> None:
        self.root = root
        self.uri = uri

    def _path(self, key: str) -> Path:
        return self.root / key

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError as exc:
            raise WeightsError(f"{key}: missing from store {self.uri}") from exc

    def put_bytes(self, key: str, data: bytes) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        # Write-then-rename: a reader never sees half a manifest.
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
        os.fchmod(fd, FILE_MODE)  # mkstemp makes 0600: a server running as another uid could not read it
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, target)

    def upload(self, local: Path, key: str, progress: ProgressFn | None = None) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        _copy(local, target, progress)
        target.chmod(FILE_MODE)

    def download(self, key: str, local: Path, progress: ProgressFn | None = None) -> None:
        source = self._path(key)
        if not source.is_file():
            raise WeightsError(f"{key}: missing from store {self.uri}")
        local.parent.mkdir(parents=True, exist_ok=True)
        _copy(source, local, progress)


class S3Store:
    def __init__(self, bucket: str, prefix: str, uri: str, endpoint_url: str | None = None) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig

        self.bucket = bucket
        self.prefix = prefix
        self.uri = uri
        # boto3 reads AWS_ENDPOINT_URL itself; an explicit endpoint wins.
        self._client: Any = boto3.client("s3", endpoint_url=endpoint_url or None)
        self._transfer = TransferConfig(
            multipart_threshold=MULTIPART_CHUNK_BYTES,
            multipart_chunksize=MULTIPART_CHUNK_BYTES,
            max_concurrency=TRANSFER_THREADS_PER_FILE,
            use_threads=True,
        )

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _missing(self, exc: Exception) -> bool:
        from botocore.exceptions import ClientError

        if not isinstance(exc, ClientError):
            return False
        code = str(exc.response.get("Error", {}).get("Code", ""))
        return code in ("404", "NoSuchKey", "NotFound")

    def get_bytes(self, key: str) -> bytes:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            response = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
            return bytes(response["Body"].read())
        except ClientError as exc:
            if self._missing(exc):
                raise WeightsError(f"{key}: missing from store {self.uri}") from exc
            raise WeightsError(f"{key}: cannot read from {self.uri}: {exc}") from exc
        except BotoCoreError as exc:
            raise WeightsError(f"{key}: cannot read from {self.uri}: {exc}") from exc

    def put_bytes(self, key: str, data: bytes) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except (ClientError, BotoCoreError) as exc:
            raise WeightsError(f"{key}: cannot write to {self.uri}: {exc}") from exc

    def upload(self, local: Path, key: str, progress: ProgressFn | None = None) -> None:
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._client.upload_file(str(local), self.bucket, self._key(key), Config=self._transfer, Callback=progress)
        except (ClientError, BotoCoreError, S3UploadFailedError) as exc:
            raise WeightsError(f"{key}: upload to {self.uri} failed: {exc}") from exc

    def download(self, key: str, local: Path, progress: ProgressFn | None = None) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        local.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._client.download_file(
                self.bucket, self._key(key), str(local), Config=self._transfer, Callback=progress
            )
        except ClientError as exc:
            if self._missing(exc):
                raise WeightsError(f"{key}: missing from store {self.uri}") from exc
            raise WeightsError(f"{key}: download from {self.uri} failed: {exc}") from exc
        except BotoCoreError as exc:
            raise WeightsError(f"{key}: download from {self.uri} failed: {exc}") from exc
