"""The server image, built with podman on a machine without a registry (`make image`).

``python -m infra.ops.image build``: install podman, runc and mmdebstrap from Debian when missing →
make the base image (Debian bookworm, Python 3.11) with mmdebstrap from the apt mirror →
``podman build`` serving/Dockerfile on the host network, with the host's pip configuration, wheel
directories and CA bundle mounted for the build only → print the image size and build time, and
fail when the size is over budget. ``python -m infra.ops.image scan``: list files the image must not
carry. ``python -m infra.ops.image size``: the size check alone. ``--variant cuda`` builds the GPU image
from NVIDIA's CUDA base and PyTorch's CUDA wheels instead (needs a registry and PyTorch's index).

``specdeploy image push --stack NAME``: push a built image to the stack's ECR repository, print the
digest ECR stored, and optionally pin it as a release slot's image in the stack file.

Podman runs as infra/runtime/podman.py configures it: storage and configuration under one persistent
directory of ours, the host network only.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.runtime.podman import PODMAN_DIR, PodmanError, image_exists, podman

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
IMAGE = "localhost/specdeploy-server:cpu"
BASE_IMAGE = "localhost/specdeploy-base:bookworm"
SUITE = "bookworm"  # Debian 12: python3 is 3.11, the only CPU torch wheel the machines carry is cp311
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
DEBIAN_PACKAGES = (
    "podman", "buildah", "runc", "mmdebstrap", "conmon", "uidmap", "fuse-overlayfs",
    "containernetworking-plugins", "catatonit", "golang-github-containers-common",
)
# Measured: 1.45 GB, of which torch's CPU wheel and its dependencies are ~1.26 GB and the Debian base
# ~0.15 GB. The budget leaves ~15 % for dependency updates; a CUDA torch (several GB) or weights baked
# in would blow it, which is what it is there to catch.
SIZE_BUDGET_BYTES = 1_700_000_000
# Not measured here (no registry): NVIDIA's cudnn-runtime base is ~3.5 GB and torch's CUDA 12.6 wheels
# with their nvidia-* libraries ~5 GB installed. Replace with the first measured build plus ~15 %.
CUDA_SIZE_BUDGET_BYTES = 12_000_000_000
# Paths (inside the image) that must not exist, and file names that must not appear anywhere.
FORBIDDEN_PATHS = ("/opt/specdeploy/app/infra", "/opt/specdeploy/app/tests", "/opt/specdeploy/app/serving/demo",
                   "/etc/pip.conf", "/etc/xdg/pip", "/root/.pip", "/root/.config/pip", "/root/.cache/pip",
                   "/home/specdeploy/.cache", "/opt/wheels", "/opt/pypi", "/opt/pypi-more")
FORBIDDEN_NAMES = re.compile(r"(^|/)(pip\.conf|\.netrc|\.pypirc|api_keys|id_rsa|id_ed25519|[^/]*\.safetensors|"
                             r"\.git)$")
TEST_FILES = re.compile(r"/(tests?|conftest\.py|test_[^/]*\.py)(/|$)")
SECRET_PATTERNS = re.compile(rb"(AKIA[0-9A-Z]{16}|sk-local-[A-Za-z0-9_-]{20,}|-----BEGIN [A-Z ]*PRIVATE KEY-----)")
SECRET_SCAN_ROOTS = ("etc/", "home/", "root/", "opt/specdeploy/app/", "tmp/", "run/")


class ImageError(PodmanError):
    """An image step failed; the message says which and why."""


@dataclass(frozen=True)
class Variant:
    """One flavour of the server image: what it is built from and how large it may be."""

    name: str
    base_image: str | None  # None: the local Debian base made by mmdebstrap (no registry needed)
    torch_index_url: str  # empty: pip's own configuration (the host's wheel directory)
    size_budget: int

    @property
    def local_tag(self) -> str:
        return f"localhost/specdeploy-server:{self.name}"


VARIANTS = {
    "cpu": Variant("cpu", None, "", SIZE_BUDGET_BYTES),
    # serving/Dockerfile's documented CUDA build; GPU stacks (aws, kubernetes with GPUs) run only this one.
    "cuda": Variant("cuda", "docker.io/nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04",
                    "https://download.pytorch.org/whl/cu126", CUDA_SIZE_BUDGET_BYTES),
}


# ---- tools and base image ------------------------------------------------------------------------------


def ensure_tools() -> None:
    missing = [tool for tool in ("podman", "buildah", "runc", "mmdebstrap") if shutil.which(tool) is None]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise ImageError(f"missing {', '.join(missing)}: install {' '.join(DEBIAN_PACKAGES)} (needs root and apt)")
    logger.info("installing %s from Debian", " ".join(DEBIAN_PACKAGES))
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", *DEBIAN_PACKAGES]):
        if subprocess.run(command, env=env).returncode != 0:
            raise ImageError(f"`{' '.join(command)}` failed")


def debian_mirror(sources: Sequence[Path] | None = None) -> str:
    """The Debian mirror apt uses here (deb822 `URIs:` or one-line `deb URL SUITE`), not the security one."""
    if sources is None:
        sources = sorted([*Path("/etc/apt").glob("sources.list"), *Path("/etc/apt/sources.list.d").glob("*.sources"),
                          *Path("/etc/apt/sources.list.d").glob("*.list")])
    for path in sources:
        text = path.read_text() if path.is_file() else ""
        for stanza in re.split(r"\n\s*\n", text):
            uris = re.search(r"^URIs:\s*(\S+)", stanza, re.MULTILINE)
            suites = re.search(r"^Suites:\s*(.+)$", stanza, re.MULTILINE)
            if uris and suites and SUITE in suites.group(1).split():
                return uris.group(1)
        for line in text.splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and parts[2] == SUITE and not parts[1].startswith("["):
                return parts[1]
    raise ImageError(f"no Debian {SUITE} mirror in {', '.join(map(str, sources)) or 'the apt sources'}")


def make_base(force: bool = False) -> float:
    """Debian bookworm minbase with Python 3.11, imported as BASE_IMAGE. Seconds spent (0 when cached)."""
    if image_exists(BASE_IMAGE) and not force:
        return 0.0
    started = time.monotonic()
    rootfs = PODMAN_DIR / "base-rootfs.tar"
    command = ["mmdebstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
               '--aptopt=Acquire::Check-Valid-Until "false"', SUITE, str(rootfs), debian_mirror()]
    logger.info("making the base image: %s", " ".join(command))
    if subprocess.run(command).returncode != 0:
        raise ImageError("mmdebstrap failed (see its output above)")
    podman("import", "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           str(rootfs), BASE_IMAGE)
    rootfs.unlink()
    return time.monotonic() - started


# ---- build ---------------------------------------------------------------------------------------------


BUILD_HOST_DIR = "/run/build-host"  # where the host's pip files appear during the build, and nowhere else


@dataclass(frozen=True)
class BuildMounts:
    """What pip needs from the host during the build: mounted, never copied into a layer.

    Every mount sits under BUILD_HOST_DIR (the mount points podman leaves in a layer are empty
    directories there, not a stray /etc/pip.conf or /opt/wheels in the image); the generated pip.conf
    names the mounted paths, and the build stage points PIP_CONFIG_FILE at it.
    """

    pip_conf: Path
    volumes: tuple[str, ...]  # podman -v arguments


def host_pip_config() -> dict[str, str]:
    """pip's effective settings on this host (files and PIP_* variables), as `pip config list` shows them."""
    result = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    if result.returncode != 0:
        raise ImageError(f"`pip config list` failed: {result.stderr.strip()}")
    settings: dict[str, str] = {}
    for line in result.stdout.splitlines():
        match = re.match(r"^(?:[\w:-]*)\.([\w-]+)='(.*)'$", line.strip())
        if match and match.group(1) not in ("disable-pip-version-check",):
            settings[match.group(1)] = match.group(2)
    return settings


def build_mounts(settings: dict[str, str]) -> BuildMounts:
    """A pip.conf for the build, and a read-only mount under BUILD_HOST_DIR for every host path it names
    (CA bundle, constraints, wheel and index directories), the settings rewritten to the mounted paths."""
    PODMAN_DIR.mkdir(parents=True, exist_ok=True)
    mounts: dict[str, str] = {}  # host path -> path in the build

    def inside(value: str) -> str:
        path = value.removeprefix("file://").rstrip("/")
        if not path.startswith("/") or not Path(path).exists():
            return value
        mounted = path
        if value.startswith("file://") and path.endswith("/simple"):
            mounted = str(Path(path).parent)  # a local index links to files beside it (../../files/...)
        elif Path(path).is_file():
            mounted = str(Path(path).parent)  # directories only: a file's mount point would stay in a layer
        if mounted not in mounts:
            mounts[mounted] = f"{BUILD_HOST_DIR}/{len(mounts)}-{Path(mounted).name}"
        return value.replace(mounted, mounts[mounted], 1)

    rewritten = {key: " ".join(inside(v) for v in value.split()) for key, value in sorted(settings.items())}
    conf = PODMAN_DIR / "build-pip" / "pip.conf"
    conf.parent.mkdir(exist_ok=True)
    conf.write_text("[global]\n" + "".join(f"{key} = {value}\n" for key, value in rewritten.items()))
    volumes = [f"{conf.parent}:{BUILD_HOST_DIR}/pip:ro", *(f"{host}:{build}:ro" for host, build in mounts.items())]
    return BuildMounts(pip_conf=conf, volumes=tuple(volumes))


def build_args(tag: str, variant: Variant, mounts: BuildMounts, no_cache: bool = False) -> list[str]:
    """podman's arguments to build serving/Dockerfile as ``variant``, tagged ``tag``."""
    args = ["build", "--format", "docker", "--network", "host", "--layers",
            "-f", str(REPO / "serving" / "Dockerfile"),
            "--ignorefile", str(REPO / "serving" / "Dockerfile.dockerignore"),
            "--build-arg", f"BASE_IMAGE={variant.base_image or BASE_IMAGE}",
            # cpu: empty, the wheel comes from the host's wheel directory; cuda: PyTorch's CUDA index
            "--build-arg", f"TORCH_INDEX_URL={variant.torch_index_url}",
            "--build-arg", f"PIP_CONFIG_FILE={BUILD_HOST_DIR}/pip/pip.conf",
            *[item for volume in mounts.volumes for item in ("-v", volume)],
            "-t", tag]
    if no_cache:
        args.append("--no-cache")
    return [*args, str(REPO)]


def build(tag: str = IMAGE, no_cache: bool = False, variant: Variant = VARIANTS["cpu"]) -> tuple[float, int]:
    """Build serving/Dockerfile (against the local base for cpu); (seconds, image bytes)."""
    mounts = build_mounts(host_pip_config())
    started = time.monotonic()
    podman(*build_args(tag, variant, mounts, no_cache))
    return time.monotonic() - started, image_size(tag)


def image_size(tag: str = IMAGE) -> int:
    return int(podman("image", "inspect", "--format", "{{.Size}}", tag, capture=True).strip())


def image_config(tag: str = IMAGE) -> dict[str, object]:
    inspected = json.loads(podman("image", "inspect", tag, capture=True))
    config: dict[str, object] = inspected[0].get("Config", {})
    return config


def check_size(size: int, budget: int = SIZE_BUDGET_BYTES) -> None:
    if size > budget:
        raise ImageError(f"image is {size / 1e9:.2f} GB, over its budget of {budget / 1e9:.2f} GB")


# ---- scan ----------------------------------------------------------------------------------------------


def export_filesystem(tag: str, dest: Path) -> Path:
    """The image's flattened filesystem as a tar (podman export of a created, never started, container)."""
    name = f"specdeploy-scan-{os.getpid()}"
    podman("create", "--name", name, tag, capture=True)
    try:
        podman("export", "-o", str(dest), name, capture=True)
    finally:
        podman("rm", "-f", name, check=False, capture=True)
    return dest


def scan_filesystem(archive: Path) -> list[str]:
    """Findings: forbidden paths and names, secrets in small text files under the places config lives."""
    findings: list[str] = []
    with tarfile.open(archive) as tar:
        for member in tar:
            path = "/" + member.name.lstrip("./")
            if any(path == bad or path.startswith(bad + "/") for bad in FORBIDDEN_PATHS):
                findings.append(f"{path}: must not be in the image")
            elif FORBIDDEN_NAMES.search(path):
                findings.append(f"{path}: unwanted file")
            elif path.startswith(BUILD_HOST_DIR + "/") and not member.isdir():
                findings.append(f"{path}: a build-time file from the host")
            elif path.startswith("/opt/specdeploy/app/") and TEST_FILES.search(path):
                findings.append(f"{path}: test file")
            elif (member.isfile() and member.size < 1_000_000
                  and any(path.startswith("/" + root) for root in SECRET_SCAN_ROOTS)):
                handle = tar.extractfile(member)
                if handle is not None and SECRET_PATTERNS.search(handle.read()):
                    findings.append(f"{path}: looks like it holds a secret")
    return sorted(set(findings))


# ---- push to a stack's ECR repository -------------------------------------------------------------------


@dataclass(frozen=True)
class PushTarget:
    """The stack's ECR repository in the account the credentials belong to."""

    account: str
    region: str
    repository: str

    @property
    def registry(self) -> str:
        return f"{self.account}.dkr.ecr.{self.region}.amazonaws.com"

    @property
    def uri(self) -> str:
        return f"{self.registry}/{self.repository}"


@dataclass(frozen=True)
class Pushed:
    image: str  # <registry>/<repository>@sha256:<digest>, what a release slot pins
    tag: str  # the immutable tag pushed beside it


def _aws_code(exc: Exception) -> str:
    response: dict[str, Any] = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def push_target(sts: Any, ecr: Any, stack: str, region: str, repository: str) -> PushTarget:
    """Who we are (sts) and that the stack's repository exists; errors say what to do about each."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        account = str(sts.get_caller_identity()["Account"])
    except (BotoCoreError, ClientError) as exc:
        raise ImageError(f"AWS credentials failed (sts get-caller-identity): {exc}; configure credentials "
                         f"for stack {stack!r}'s account (AWS_PROFILE, or the pipeline's role)") from None
    try:
        ecr.describe_repositories(repositoryNames=[repository])
    except ClientError as exc:
        if _aws_code(exc) == "RepositoryNotFoundException":
            raise ImageError(f"ECR repository {repository!r} does not exist in account {account}, {region}: run "
                             f"`pulumi up --stack {stack}` first (the bootstrap creates it with the fleet at 0)"
                             ) from None
        raise ImageError(f"ECR describe-repositories {repository!r} failed: {exc}") from None
    except BotoCoreError as exc:
        raise ImageError(f"ECR describe-repositories {repository!r} failed: {exc}") from None
    return PushTarget(account, region, repository)


def registry_credentials(ecr: Any) -> tuple[str, str]:
    """(user, password) for ``podman login`` from ECR's authorization token (base64 of ``user:password``)."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        data = ecr.get_authorization_token()["authorizationData"][0]
    except (BotoCoreError, ClientError) as exc:
        raise ImageError(f"ECR get-authorization-token failed: {exc}") from None
    user, sep, password = base64.b64decode(data["authorizationToken"]).decode().partition(":")
    if not sep or not password:
        raise ImageError("ECR returned an authorization token that is not user:password")
    return user, password


def login_args(target: PushTarget, user: str, auth_file: Path) -> list[str]:
    """podman login; the password goes to standard input, never onto the command line."""
    return ["login", "--authfile", str(auth_file), "--username", user, "--password-stdin", target.registry]


def push_args(local: str, target: PushTarget, tag: str, auth_file: Path, digest_file: Path) -> list[str]:
    """podman push of ``local`` to ``<repository>:<tag>``; podman writes the manifest digest ECR stores."""
    return ["push", "--authfile", str(auth_file), "--digestfile", str(digest_file), local, f"{target.uri}:{tag}"]


def remote_tag(variant: Variant, now: float | None = None) -> str:
    """A tag never used before (the repository's tags are immutable): variant, UTC time, commit."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"],
                            capture_output=True, text=True)
    suffix = f"-{commit.stdout.strip()}" if commit.returncode == 0 and commit.stdout.strip() else ""
    return f"{variant.name}-{stamp}{suffix}"


PodmanRunner = Callable[..., str]


def push(local: str, target: PushTarget, ecr: Any, tag: str, run: PodmanRunner | None = None,
         exists: Callable[[str], bool] | None = None) -> Pushed:
    """Log in with a throw-away auth file, push, and confirm ECR holds the digest podman reported.

    ``run`` and ``exists`` default to podman itself (tests give a registry double)."""
    from infra.components.aws.release_artifacts import missing_image

    run = run or podman
    if not (exists or image_exists)(local):
        raise ImageError(f"image {local} is not built here: run `make image` (cpu) or "
                         f"`specdeploy image build --variant cuda` first")
    user, password = registry_credentials(ecr)
    with tempfile.TemporaryDirectory(prefix="specdeploy-push-") as scratch:
        auth_file, digest_file = Path(scratch) / "auth.json", Path(scratch) / "digest"
        run(*login_args(target, user, auth_file), stdin=password, capture=True)
        run(*push_args(local, target, tag, auth_file, digest_file))
        digest = digest_file.read_text().strip() if digest_file.is_file() else ""
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        raise ImageError(f"podman push reported no image digest (got {digest!r})")
    image = f"{target.uri}@{digest}"
    reason = missing_image(ecr, image)
    if reason:
        raise ImageError(f"pushed, but ECR does not list it: {reason}")
    return Pushed(image=image, tag=tag)


# ---- command line --------------------------------------------------------------------------------------


def pin_slot(stack_path: Path, slot: str, image: str) -> bool:
    """Make release.<slot>.image in the stack file ``image`` (nothing else changes); False if it already was."""
    import yaml

    from infra.config import ConfigError, ReleaseSpec, parse_stack_mapping
    from infra.ops.release.model import ReleaseError
    from infra.ops.release.stackfile import write_release

    document = yaml.safe_load(stack_path.read_text(encoding="utf-8")) or {}
    try:
        config, _, _ = parse_stack_mapping(document.get("config") or {}, source=str(stack_path))
        release = config.slots
        spec = release.slot(slot)
        if spec is None:
            raise ImageError(f"{stack_path}: release.{slot} is not defined; pin the image of a defined slot, or "
                             f"start a release into {slot} with `specdeploy rollout`")
        updated = ReleaseSpec.model_validate(
            {**release.model_dump(), slot: {**spec.model_dump(), "image": image}})
        return write_release(stack_path, updated)
    except (ConfigError, ReleaseError, ValueError) as exc:
        raise ImageError(f"cannot pin release.{slot}.image: {exc}") from None


def _variant(args: argparse.Namespace) -> Variant:
    return VARIANTS[args.variant]


def _tag(args: argparse.Namespace) -> str:
    return str(args.tag or _variant(args).local_tag)


def build_command(args: argparse.Namespace) -> int:
    variant, tag = _variant(args), _tag(args)
    if variant.base_image is None:
        ensure_tools()
        base_s = make_base(force=args.rebuild_base)
        base = f" + base {base_s:.0f}s" if base_s else " (base cached)"
    else:  # the base comes from its registry: podman alone
        if shutil.which("podman") is None:
            raise ImageError(f"podman is not installed (needed to build the {variant.name} image)")
        base = f" (base {variant.base_image})"
    seconds, size = build(tag, no_cache=args.no_cache, variant=variant)
    logger.info("image %s: %.2f GB (budget %.2f GB), built in %.0fs%s",
                tag, size / 1e9, variant.size_budget / 1e9, seconds, base)
    sys.stdout.write(f"image {tag}: size {size / 1e9:.2f} GB (budget {variant.size_budget / 1e9:.2f} GB), "
                     f"build {seconds:.0f}s{base}\n")
    check_size(size, variant.size_budget)
    return 0


def scan_command(args: argparse.Namespace) -> int:
    tag = _tag(args)
    archive = PODMAN_DIR / "scan.tar"
    try:
        findings = scan_filesystem(export_filesystem(tag, archive))
    finally:
        archive.unlink(missing_ok=True)
    for finding in findings:
        sys.stdout.write(finding + "\n")
    sys.stdout.write(f"scan of {tag}: {len(findings)} finding(s)\n")
    return 1 if findings else 0


def size_command(args: argparse.Namespace) -> int:
    variant, tag = _variant(args), _tag(args)
    size = image_size(tag)
    sys.stdout.write(f"image {tag}: {size / 1e9:.2f} GB (budget {variant.size_budget / 1e9:.2f} GB)\n")
    check_size(size, variant.size_budget)
    return 0


def add_image_arguments(parser: argparse.ArgumentParser, default_variant: str | None = "cpu") -> None:
    """--variant and --tag, shared by every image subcommand (here and `specdeploy image`)."""
    parser.add_argument("--variant", choices=sorted(VARIANTS), default=default_variant,
                        help=f"image variant (default {default_variant or 'from the stack'})")
    parser.add_argument("--tag", default=None,
                        help="local image name (default localhost/specdeploy-server:<variant>)")


def add_build_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-cache", action="store_true", help="rebuild every layer")
    parser.add_argument("--rebuild-base", action="store_true", help="remake the Debian base image (cpu)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.ops.image", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build_parser = sub.add_parser("build", help="build the server image with podman (cpu or cuda)")
    add_build_arguments(build_parser)
    build_parser.set_defaults(func=build_command)
    sub.add_parser("scan", help="fail on secrets or unwanted files in the image").set_defaults(func=scan_command)
    sub.add_parser("size", help="fail when the image is over its size budget").set_defaults(func=size_command)
    for child in sub.choices.values():
        add_image_arguments(child)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        code: int = args.func(args)
    except PodmanError as exc:  # ImageError included
        sys.stderr.write(f"image: error: {exc}\n")
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
