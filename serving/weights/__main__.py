"""`python -m serving.weights pull URI DIR | verify DIR`: the weight pull the server image runs itself.

Instances (user-data) and Kubernetes init containers pull with the image they serve with, which
carries serving/ only; the operator's `specdeploy weights …` command does the same with progress
bars. Exit 0 on success, 2 with one line naming the problem otherwise.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from serving.weights import WeightsError, pull, verify_dir


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m serving.weights",
                                     description="Pull a model version into a local cache, verified, or verify one.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    pull_parser = commands.add_parser("pull", help="download URI into DIR, verify every hash, rename into place")
    pull_parser.add_argument("uri", help="s3://bucket/prefix or file:///dir of the version")
    pull_parser.add_argument("directory", type=Path, help="cache directory of this version")
    pull_parser.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint (default: AWS)")
    verify_parser = commands.add_parser("verify", help="check DIR against its manifest.json")
    verify_parser.add_argument("directory", type=Path)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "pull":
            result = pull(args.uri, args.directory, args.endpoint_url)
            state = "pulled and verified" if result.fetched else "already verified"
            sys.stdout.write(f"{args.directory}: {state}, {len(result.manifest.files)} files\n")
        else:
            manifest = verify_dir(args.directory)
            sys.stdout.write(f"{args.directory}: verified, {len(manifest.files)} files\n")
    except WeightsError as exc:
        sys.stderr.write(f"weights: error: {exc}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
