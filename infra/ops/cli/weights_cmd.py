"""`specdeploy weights push|pull|verify`: model versions in s3:// or file:// stores."""

from __future__ import annotations

import argparse
import threading
from pathlib import Path
from typing import Any

from infra.ops.cli.main import CommandError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("weights", help="push, pull and verify model versions (manifest.json)")
    sub = parser.add_subparsers(dest="weights_command", metavar="ACTION", required=True)

    push = sub.add_parser("push", help="upload DIR to URI; the manifest goes last")
    push.add_argument("directory", type=Path, metavar="DIR")
    push.add_argument("uri", metavar="URI", help="s3://bucket/prefix or file:///path")
    _add_common(push)
    push.set_defaults(func=_push)

    pull = sub.add_parser("pull", help="download URI into DIR, verify every hash, rename into place")
    pull.add_argument("uri", metavar="URI")
    pull.add_argument("directory", type=Path, metavar="DIR")
    _add_common(pull)
    pull.set_defaults(func=_pull)

    verify = sub.add_parser("verify", help="check DIR against its manifest.json")
    verify.add_argument("directory", type=Path, metavar="DIR")
    verify.add_argument("--quiet", action="store_true", help="no progress bar")
    verify.set_defaults(func=_verify)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--endpoint-url", default=None, help="S3-compatible endpoint (default: $AWS_ENDPOINT_URL, else AWS)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


class RichProgress:
    """One bar per phase (hashing, uploading, downloading, verifying); thread-safe advance."""

    def __init__(self, enabled: bool) -> None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TaskID,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._progress = Progress(
            TextColumn("{task.description:>16}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            disable=not enabled,
            transient=False,
        )
        self._task: TaskID | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> RichProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def begin(self, description: str, total_bytes: int) -> None:
        with self._lock:
            self._task = self._progress.add_task(description, total=total_bytes)

    def advance(self, nbytes: int) -> None:
        with self._lock:
            if self._task is not None:
                self._progress.advance(self._task, nbytes)


def _push(args: argparse.Namespace) -> int:
    from rich.console import Console

    from serving.weights import WeightsError, push

    try:
        with RichProgress(not args.quiet) as progress:
            manifest = push(args.directory, args.uri, args.endpoint_url, progress)
    except WeightsError as exc:
        raise CommandError(str(exc)) from exc
    Console().print(f"pushed {len(manifest.files)} files, {manifest.total_bytes} bytes -> {args.uri}")
    return 0


def _pull(args: argparse.Namespace) -> int:
    from rich.console import Console

    from serving.weights import WeightsError, pull

    try:
        with RichProgress(not args.quiet) as progress:
            result = pull(args.uri, args.directory, args.endpoint_url, progress)
    except WeightsError as exc:
        raise CommandError(str(exc)) from exc
    what = "pulled and verified" if result.fetched else "already present and verified"
    Console().print(f"{what}: {len(result.manifest.files)} files, {result.manifest.total_bytes} bytes in {result.path}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from rich.console import Console

    from serving.weights import WeightsError, load_manifest, verify_dir

    try:
        manifest = load_manifest(args.directory)
        with RichProgress(not args.quiet) as progress:
            progress.begin("verifying", manifest.total_bytes)
            verify_dir(args.directory, manifest, progress.advance)
    except WeightsError as exc:
        raise CommandError(str(exc)) from exc
    Console().print(f"verified: {len(manifest.files)} files, {manifest.total_bytes} bytes in {args.directory}")
    return 0
