"""The server image, built with podman on a machine without a registry (`make image`).

``python -m infra.ops.image build``: install podman, runc and mmdebstrap from Debian when missing →
make the base image (Debian bookworm, Python 3.11) with mmdebstrap from the apt mirror →
``podman build`` serving/Dockerfile on the host network, with the host's pip configuration, wheel
directories and CA bundle mounted for the build only → print the image size and build time, and
fail when the size is over budget. ``python -m infra.ops.image scan``: list files the image must not
carry. ``python -m infra.ops.image size``: the size check alone.

Podman's storage and configuration live in one persistent directory of ours (``$SPECDEPLOY_PODMAN_DIR``,
default /var/tmp/specdeploy-podman), so a fresh checkout reuses the layer cache; the host's networking is
never changed (host network only: no bridge, no iptables rules).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
PODMAN_DIR = Path(os.environ.get("SPECDEPLOY_PODMAN_DIR", "/var/tmp/specdeploy-podman"))
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
# Paths (inside the image) that must not exist, and file names that must not appear anywhere.
FORBIDDEN_PATHS = ("/opt/specdeploy/app/infra", "/opt/specdeploy/app/tests", "/opt/specdeploy/app/serving/demo",
                   "/etc/pip.conf", "/etc/xdg/pip", "/root/.pip", "/root/.config/pip", "/root/.cache/pip",
                   "/home/specdeploy/.cache", "/opt/wheels", "/opt/pypi", "/opt/pypi-more")
FORBIDDEN_NAMES = re.compile(r"(^|/)(pip\.conf|\.netrc|\.pypirc|api_keys|id_rsa|id_ed25519|[^/]*\.safetensors|"
                             r"\.git)$")
TEST_FILES = re.compile(r"/(tests?|conftest\.py|test_[^/]*\.py)(/|$)")
SECRET_PATTERNS = re.compile(rb"(AKIA[0-9A-Z]{16}|sk-local-[A-Za-z0-9_-]{20,}|-----BEGIN [A-Z ]*PRIVATE KEY-----)")
SECRET_SCAN_ROOTS = ("etc/", "home/", "root/", "opt/specdeploy/app/", "tmp/", "run/")


class ImageError(Exception):
    """An image step failed; the message says which and why."""


# ---- podman, configured under our own directory ------------------------------------------------------


def podman_env() -> dict[str, str]:
    """The environment podman and buildah run with: storage and config files under PODMAN_DIR."""
    write_podman_config()
    env = dict(os.environ)
    env["CONTAINERS_STORAGE_CONF"] = str(PODMAN_DIR / "storage.conf")
    env["CONTAINERS_REGISTRIES_CONF"] = str(PODMAN_DIR / "registries.conf")
    env["CONTAINERS_CONF"] = str(PODMAN_DIR / "containers.conf")
    return env


def write_podman_config() -> None:
    PODMAN_DIR.mkdir(parents=True, exist_ok=True)
    nofile = _hard_nofile()
    files = {
        "storage.conf": (f'[storage]\ndriver = "overlay"\ngraphroot = "{PODMAN_DIR / "storage"}"\n'
                         f'runroot = "{PODMAN_DIR / "run"}"\n'),
        # Nothing is ever pulled: no search registries, short names refused.
        "registries.conf": 'unqualified-search-registries = []\nshort-name-mode = "disabled"\n',
        # crun fails here (cgroups hybrid mode); rootful default ulimits exceed what we may set;
        # the host network leaves the host's interfaces and iptables alone.
        "containers.conf": (f'[containers]\nnetns = "host"\n'
                            f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc=32768:32768"]\n'
                            f'[engine]\nruntime = "runc"\n'),
    }
    for name, text in files.items():
        path = PODMAN_DIR / name
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)


def _hard_nofile() -> int:
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return hard if hard != resource.RLIM_INFINITY else 1048576


def podman(*args: str, check: bool = True, capture: bool = False, timeout: float | None = None) -> str:
    """Run podman with our configuration; the error names the command and shows its output."""
    if shutil.which("podman") is None:
        raise ImageError("podman is not installed (`make image` installs it from Debian)")
    result = subprocess.run(["podman", *args], env=podman_env(), text=True, timeout=timeout,
                            stdout=subprocess.PIPE if capture else None,
                            stderr=subprocess.PIPE if capture else None)
    if check and result.returncode != 0:
        detail = (result.stderr or "").strip()[-2000:] if capture else "see the output above"
        raise ImageError(f"podman {' '.join(args[:2])} failed (exit {result.returncode}): {detail}")
    return result.stdout or ""


def image_exists(name: str = IMAGE) -> bool:
    if shutil.which("podman") is None:
        return False
    return subprocess.run(["podman", "image", "exists", name], env=podman_env()).returncode == 0


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


def build(tag: str = IMAGE, no_cache: bool = False) -> tuple[float, int]:
    """Build serving/Dockerfile against the local base; (seconds, image bytes)."""
    mounts = build_mounts(host_pip_config())
    args = ["build", "--format", "docker", "--network", "host", "--layers",
            "-f", str(REPO / "serving" / "Dockerfile"),
            "--ignorefile", str(REPO / "serving" / "Dockerfile.dockerignore"),
            "--build-arg", f"BASE_IMAGE={BASE_IMAGE}",
            "--build-arg", "TORCH_INDEX_URL=",  # the CPU wheel comes from the host's wheel directory
            "--build-arg", f"PIP_CONFIG_FILE={BUILD_HOST_DIR}/pip/pip.conf",
            *[item for volume in mounts.volumes for item in ("-v", volume)],
            "-t", tag]
    if no_cache:
        args.append("--no-cache")
    started = time.monotonic()
    podman(*args, str(REPO))
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


# ---- command line --------------------------------------------------------------------------------------


def _build_command(args: argparse.Namespace) -> int:
    ensure_tools()
    base_s = make_base(force=args.rebuild_base)
    seconds, size = build(args.tag, no_cache=args.no_cache)
    base = f" + base {base_s:.0f}s" if base_s else " (base cached)"
    logger.info("image %s: %.2f GB (budget %.2f GB), built in %.0fs%s",
                args.tag, size / 1e9, SIZE_BUDGET_BYTES / 1e9, seconds, base)
    sys.stdout.write(f"image {args.tag}: size {size / 1e9:.2f} GB (budget {SIZE_BUDGET_BYTES / 1e9:.2f} GB), "
                     f"build {seconds:.0f}s{base}\n")
    check_size(size)
    return 0


def _scan_command(args: argparse.Namespace) -> int:
    archive = PODMAN_DIR / "scan.tar"
    try:
        findings = scan_filesystem(export_filesystem(args.tag, archive))
    finally:
        archive.unlink(missing_ok=True)
    for finding in findings:
        sys.stdout.write(finding + "\n")
    sys.stdout.write(f"scan of {args.tag}: {len(findings)} finding(s)\n")
    return 1 if findings else 0


def _size_command(args: argparse.Namespace) -> int:
    size = image_size(args.tag)
    sys.stdout.write(f"image {args.tag}: {size / 1e9:.2f} GB (budget {SIZE_BUDGET_BYTES / 1e9:.2f} GB)\n")
    check_size(size)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.ops.image", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build_parser = sub.add_parser("build", help="build the CPU server image with podman")
    build_parser.add_argument("--no-cache", action="store_true", help="rebuild every layer")
    build_parser.add_argument("--rebuild-base", action="store_true", help="remake the Debian base image")
    build_parser.set_defaults(func=_build_command)
    sub.add_parser("scan", help="fail on secrets or unwanted files in the image").set_defaults(func=_scan_command)
    sub.add_parser("size", help="fail when the image is over its size budget").set_defaults(func=_size_command)
    for child in sub.choices.values():
        child.add_argument("--tag", default=IMAGE, help=f"image name (default {IMAGE})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        code: int = args.func(args)
    except ImageError as exc:
        sys.stderr.write(f"image: error: {exc}\n")
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
