"""Podman, configured under one persistent directory of ours.

Storage and configuration live in ``$SPECDEPLOY_PODMAN_DIR`` (default /var/tmp/specdeploy-podman), so
a fresh checkout reuses the layer cache, and the host's networking is never changed (host network only:
no bridge, no iptables rules). The image build (infra/ops/image.py), the local platform's container
runtime (infra/runtime/container.py) and the launch checks' ``podman://`` hosts all run podman this way.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

PODMAN_DIR = Path(os.environ.get("SPECDEPLOY_PODMAN_DIR", "/var/tmp/specdeploy-podman"))


class PodmanError(Exception):
    """A podman command failed; the message names it and shows its output."""


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


def podman(*args: str, check: bool = True, capture: bool = False, timeout: float | None = None,
           stdin: str | None = None) -> str:
    """Run podman with our configuration; the error names the command and shows its output.

    ``stdin`` is written to podman's standard input (a registry password, never an argument)."""
    if shutil.which("podman") is None:
        raise PodmanError("podman is not installed (`make image` installs it from Debian)")
    result = subprocess.run(["podman", *args], env=podman_env(), text=True, timeout=timeout, input=stdin,
                            stdout=subprocess.PIPE if capture else None,
                            stderr=subprocess.PIPE if capture else None)
    if check and result.returncode != 0:
        detail = (result.stderr or "").strip()[-2000:] if capture else "see the output above"
        raise PodmanError(f"podman {' '.join(args[:2])} failed (exit {result.returncode}): {detail}")
    return result.stdout or ""


def image_exists(name: str) -> bool:
    if shutil.which("podman") is None:
        return False
    return subprocess.run(["podman", "image", "exists", name], env=podman_env()).returncode == 0
