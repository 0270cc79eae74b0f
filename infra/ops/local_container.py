"""The local platform's `container` runtime: the server image under podman, on the host network.

The verified weights directory is mounted read-only at /data/models, the rendered config at
$SPECDEPLOY_CONFIG, the API key file at /run/secrets/api_keys (owned by the image's user, mode 0600);
the container's log goes to the state directory. `stop` is `podman stop` with a timeout of the drain
grace (plus a margin for the interpreter to exit): SIGTERM drains in-flight requests, then exit 0.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.ops.image import ImageError, image_exists, podman, podman_env

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
            raise ImageError(f"image {self.image} not found: build it with `make image`")
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
            raise ImageError(f"container {self.name} exited at once (exit code {state.exit_code})")
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


class TwinUnavailable(RuntimeError):
    """The deployed container's config cannot run with the override (e.g. speculation on, no draft model)."""


@dataclass(frozen=True)
class TwinContainer:
    """A second container of a deployed one's image, mounts and settings, differing in chosen settings."""

    name: str
    endpoint: str
    stop_timeout_s: int

    def stop(self) -> None:
        podman("stop", "--time", str(self.stop_timeout_s), self.name, check=False, capture=True)
        podman("rm", "--force", "--ignore", self.name, check=False, capture=True)


def start_twin(container: str, overrides: Mapping[str, str], log_file: Path,
               ready_timeout_s: float = 180) -> TwinContainer:
    """Run a twin of the running container ``container``: its image, its mounts (read-only as they
    were), its ``SPECDEPLOY*`` environment plus ``overrides``, on a free loopback port of the host
    network. For the local stack's speculative A/B: the server has no runtime switch for speculation."""
    from serving.config import ConfigError, load_server_config
    from serving.net import NotReady, free_port, wait_until_ready

    found = json.loads(podman("container", "inspect", container, capture=True))
    if not found or not found[0].get("State", {}).get("Running"):
        raise TwinUnavailable(f"container {container} is not running")
    data: dict[str, Any] = found[0]
    env = dict(item.partition("=")[::2] for item in data["Config"].get("Env") or [])
    env = {key: value for key, value in env.items() if key.startswith("SPECDEPLOY")}
    port = free_port()
    env.update(overrides)
    env["SPECDEPLOY__SERVICE__PORT"] = str(port)
    mounts = data.get("Mounts") or []
    config_inside = env.get("SPECDEPLOY_CONFIG", CONFIG_MOUNT)
    config_host = next((Path(m["Source"]) for m in mounts if m["Destination"] == config_inside), None)
    if config_host is None:
        raise TwinUnavailable(f"container {container} has no config file mounted at {config_inside}")
    try:
        config = load_server_config(config_host, env)
    except ConfigError as exc:
        raise TwinUnavailable(f"{config_host} with {dict(overrides)} is not a valid server config: {exc}") from exc
    name = f"{container}-twin"
    podman("rm", "--force", "--ignore", name, check=False, capture=True)
    volumes = [item for m in mounts
               for item in ("--volume", f"{m['Source']}:{m['Destination']}{'' if m.get('RW') else ':ro'}")]
    image = data.get("ImageName") or data["Image"]
    stop_timeout = math.ceil(config.service.drain_grace_s) + STOP_MARGIN_S
    podman("run", "--detach", "--name", name, "--network", "host", "--stop-timeout", str(stop_timeout),
           *volumes, *(item for key, value in sorted(env.items()) for item in ("--env", f"{key}={value}")),
           "--log-driver", "k8s-file", "--log-opt", f"path={log_file}", image, capture=True)
    host = "127.0.0.1" if config.service.host in ("0.0.0.0", "::", "") else config.service.host
    twin = TwinContainer(name=name, endpoint=f"http://{host}:{port}", stop_timeout_s=stop_timeout)
    try:
        wait_until_ready(twin.endpoint, ready_timeout_s)
    except NotReady as exc:
        twin.stop()
        tail = log_file.read_text(encoding="utf-8", errors="replace")[-2000:] if log_file.is_file() else ""
        raise RuntimeError(f"twin container {name}: {exc}\n--- its log ---\n{tail}") from exc
    return twin
