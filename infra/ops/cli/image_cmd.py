"""`specdeploy image build|scan|push`: the server image, from this checkout to the stack's ECR repository.

`push` is how a new account gets its first image: the first `pulumi up` creates the stack's
repository (specdeploy-<stack>) with the fleet at zero, `image push --pin-slot blue` puts the
image there and writes its digest into the stack file, and the next `pulumi up` starts the fleet.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from infra.ops.cli.main import CommandError


def register(subparsers: Any) -> None:
    from infra.config import SLOTS
    from infra.ops.image import add_build_arguments, add_image_arguments

    parser = subparsers.add_parser("image", help="build, scan and push the server image (podman)")
    sub = parser.add_subparsers(dest="image_command", metavar="ACTION", required=True)

    build = sub.add_parser("build", help="build the server image (cpu: no registry needed; cuda: for GPU stacks)")
    add_build_arguments(build)
    add_image_arguments(build)
    build.set_defaults(func=_image_step("build_command"))

    scan = sub.add_parser("scan", help="fail on secrets or unwanted files in the image")
    add_image_arguments(scan)
    scan.set_defaults(func=_image_step("scan_command"))

    push = sub.add_parser(
        "push", help="push a built image to the stack's ECR repository and print its digest",
        description="Push the local image to the stack's ECR repository (fleet.image_repository, default "
        "specdeploy-<stack>; registry <account>.dkr.ecr.<region>.amazonaws.com, the account from the current "
        "AWS credentials, the region from the stack's aws:region), under a new immutable tag. Prints "
        "<repository-uri>@sha256:<digest>; --pin-slot writes it into the stack file as that slot's image.")
    push.add_argument("--stack", required=True, help="stack whose repository receives the image")
    add_image_arguments(push, default_variant=None)
    push.add_argument("--pin-slot", choices=(*SLOTS, "active"), default=None,
                      help="write the pushed image (by digest) as release.<slot>.image in the stack file "
                      "(active: the stack's release.active)")
    push.add_argument("--stacks-dir", type=Path, help=argparse.SUPPRESS)
    push.set_defaults(func=_push)


def _image_step(name: str) -> Any:
    def run(args: argparse.Namespace) -> int:
        from infra.ops import image

        try:
            code: int = getattr(image, name)(args)
        except image.PodmanError as exc:  # ImageError included
            raise CommandError(str(exc)) from exc
        return code

    return run


def _push(args: argparse.Namespace) -> int:
    import boto3

    from infra.config import load_stack
    from infra.ops.image import VARIANTS, pin_slot, push, push_target, remote_tag
    from infra.program.aws_args import repository_name
    from infra.runtime.podman import PodmanError

    stack = load_stack(args.stack, args.stacks_dir)
    config = stack.config
    if config.platform != "aws":
        raise CommandError(f"stack {args.stack!r} is platform {config.platform}: `image push` targets the ECR "
                           "repository of an aws stack")
    region = stack.providers.get("aws:region")
    if not region:
        raise CommandError(f"stack {args.stack!r}: aws:region is not set")
    gpu_variant = "cuda" if config.serves_on_gpu else "cpu"
    variant = VARIANTS[args.variant or gpu_variant]
    if config.serves_on_gpu and variant.name != "cuda":
        raise CommandError(f"stack {args.stack!r} serves on GPUs (model.device: cuda): push the cuda variant "
                           "(`specdeploy image build --variant cuda`), a cpu image would never become ready")
    local = args.tag or variant.local_tag
    try:
        target = push_target(boto3.client("sts", region_name=region), ecr := boto3.client("ecr", region_name=region),
                             args.stack, region, repository_name(config, args.stack))
        pushed = push(local, target, ecr, remote_tag(variant))
        sys.stdout.write(f"pushed {local} as {target.uri}:{pushed.tag}\n{pushed.image}\n")
        if args.pin_slot:
            slot = config.slots.active if args.pin_slot == "active" else args.pin_slot
            changed = pin_slot(stack.path, slot, pushed.image)
            sys.stdout.write(f"{stack.path}: release.{slot}.image "
                             f"{'pinned to' if changed else 'already'} {pushed.image}\n")
    except PodmanError as exc:  # ImageError included
        raise CommandError(str(exc)) from exc
    return 0
