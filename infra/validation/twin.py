"""Twins for the speculative A/B: a second server of the deployed one, differing in one setting.

The server has no runtime switch for speculation, so a local stack's A/B compares the deployed
server with a twin that changes exactly ``SPECDEPLOY__SPECULATIVE__ENABLED`` (and the port): for a
process, the same config file, environment, working directory and user (infra/runtime/process.py);
for a container, the same image, mounts and ``SPECDEPLOY*`` environment (infra/runtime/container.py).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from infra.runtime.container import CONFIG_MOUNT, STOP_MARGIN_S, TwinContainer
from infra.runtime.podman import podman
from infra.runtime.process import ServerProcess, config_path_of, run_as, wait_ready_or_raise

_CAP_DAC_READ_SEARCH = 2


class TwinUnavailable(RuntimeError):
    """The deployed server's config cannot run with the override (e.g. speculation on, no draft model)."""


def start_process_twin(pid: int, overrides: Mapping[str, str], log_path: Path,
                       ready_timeout_s: float = 180) -> ServerProcess:
    """Start a server with the config file and environment of process ``pid``, plus ``overrides``
    (``SPECDEPLOY__SECTION__KEY`` variables), on a free loopback port."""
    import testinfra

    from infra.validation import hostfacts
    from serving.config import ConfigError, load_server_config
    from serving.net import free_port

    host = testinfra.get_host("local://")
    cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
    environ = hostfacts.process_environ(host, pid)
    config = config_path_of(hostfacts.process_argv(host, pid), environ, cwd)
    if config is None:
        raise RuntimeError(f"process {pid} shows no --config or SPECDEPLOY_CONFIG; cannot start a twin of it")
    env = {**environ, **overrides}
    try:
        load_server_config(config, env)
    except ConfigError as exc:
        raise TwinUnavailable(f"{config} with {dict(overrides)} is not a valid server config: {exc}") from exc
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    uid, gid = int(status["Uid"].split()[0]), int(status["Gid"].split()[0])
    ambient = int(status.get("CapAmb", "0").strip(), 16)
    wrapper: list[str] = []
    if os.geteuid() == 0 and uid != 0:  # the twin runs as the same user, with the same ambient capability
        wrapper = run_as(uid, gid, read_anywhere=bool(ambient >> _CAP_DAC_READ_SEARCH & 1))
    twin = ServerProcess(config, free_port(), env, log_path, cwd=cwd, wrapper=wrapper)
    return twin.start(ready_timeout_s)


def start_container_twin(container: str, overrides: Mapping[str, str], log_file: Path,
                         ready_timeout_s: float = 180) -> TwinContainer:
    """Run a twin of the running container ``container``: its image, its mounts (read-only as they
    were), its ``SPECDEPLOY*`` environment plus ``overrides``, on a free loopback port of the host
    network."""
    from serving.config import ConfigError, load_server_config
    from serving.net import free_port

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
    wait_ready_or_raise(twin.endpoint, ready_timeout_s, log_file, twin.stop, what=f"twin container {name}")
    return twin
