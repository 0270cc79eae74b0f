"""The server image as a container on this machine, under podman, on the host network.

The local platform's `container` runtime (infra/ops/local.py) runs one; the launch checks' speculative
A/B runs a twin of it.

The verified weights directory is mounted read-only at /data/models, the rendered config at
$SPECDEPLOY_CONFIG, the API key file at /run/secrets/api_keys (owned by the image's user, mode 0600);
the container's log goes to the state directory. `stop` is `podman stop` with a timeout of the drain
grace (plus a margin for the interpreter to exit): SIGTERM drains in-flight requests, then exit 0.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from infra.runtime.podman import PodmanError, image_exists, podman, podman_env

IMAGE_UID = 10001  # the image's USER (serving/Dockerfile)
MODELS_MOUNT = "/data/models"
CONFIG_MOUNT = "/etc/specdeploy/server.yaml"  # the image's SPECDEPLOY_CONFIG
API_KEYS_MOUNT = "/run/secrets/api_keys"
STOP_MARGIN_S = 5  # after the drain: the engine loop stops and the interpreter exits


@dataclass(frozen=True)
class ContainerState:
    running: bool
    pid: int | None  # host pid of the server process
    exit_code: int | None


@dataclass(frozen=True)
class ServerContainer:
    name: str
    image: str
    drain_grace_s: float
    port: int  # service.port, also given to the HEALTHCHECK (it reads SPECDEPLOY__SERVICE__PORT)

    def start(self, models_dir: Path, server_config: Path, api_keys_file: Path, log_file: Path) -> int:
        """Run the image detached; the host pid of its server process."""
        if not image_exists(self.image):
            raise PodmanError(f"image {self.image} not found: build it with `make image`")
        self.remove()  # a stopped container left by an earlier run
        if os.geteuid() == 0:
            os.chown(api_keys_file, IMAGE_UID, IMAGE_UID)  # still 0600: readable by the server's uid alone
        podman(
            "run", "--detach", "--name", self.name, "--network", "host",
            "--stop-timeout", str(self.stop_timeout_s),
            "--volume", f"{models_dir}:{MODELS_MOUNT}:ro",
            "--volume", f"{server_config}:{CONFIG_MOUNT}:ro",
            "--volume", f"{api_keys_file}:{API_KEYS_MOUNT}:ro",
            "--env", "SPECDEPLOY_ENV=production",
            "--env", f"SPECDEPLOY__SERVICE__PORT={self.port}",
            "--log-driver", "k8s-file", "--log-opt", f"path={log_file}",
            self.image,
            capture=True,
        )
        state = self.state()
        if state.pid is None:
            raise PodmanError(f"container {self.name} exited at once (exit code {state.exit_code})")
        return state.pid

    @property
    def stop_timeout_s(self) -> int:
        return math.ceil(self.drain_grace_s) + STOP_MARGIN_S

    def state(self) -> ContainerState:
        if shutil.which("podman") is None:
            return ContainerState(running=False, pid=None, exit_code=None)
        out = podman("container", "inspect", "--format", "{{.State.Running}} {{.State.Pid}} {{.State.ExitCode}}",
                     self.name, check=False, capture=True).split()
        if len(out) != 3:
            return ContainerState(running=False, pid=None, exit_code=None)
        running = out[0] == "true"
        return ContainerState(running=running, pid=int(out[1]) if running else None, exit_code=int(out[2]))

    def stop(self) -> int | None:
        """`podman stop` (SIGTERM, drain, SIGKILL after the stop timeout); the exit code, None if absent."""
        if self.state().exit_code is None:
            return None
        podman("stop", "--time", str(self.stop_timeout_s), self.name, capture=True)
        code = self.state().exit_code
        self.remove()
        return code

    def remove(self) -> None:
        podman("rm", "--force", "--ignore", self.name, check=False, capture=True)

    def healthcheck(self) -> bool:
        """The image's HEALTHCHECK, run now (podman's periodic timer needs systemd)."""
        result = subprocess.run(["podman", "healthcheck", "run", self.name], env=podman_env(),
                                capture_output=True, text=True, timeout=30)
        return result.returncode == 0


@dataclass(frozen=True)
class TwinContainer:
    """A second container of a deployed one's image, mounts and settings, differing in chosen settings."""

    name: str
    endpoint: str
    stop_timeout_s: int

    def stop(self) -> None:
        podman("stop", "--time", str(self.stop_timeout_s), self.name, check=False, capture=True)
        podman("rm", "--force", "--ignore", self.name, check=False, capture=True)
