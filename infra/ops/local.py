"""The local platform: the whole chain on this machine, no cloud.

``up``: push the model pair to the stack's file:// store → pull and verify into the state
directory → render the server config from the stack → start ``specdeploy serve`` in the
background on loopback (pid and log under the state directory) → wait for /ready.
``down``: SIGTERM (the server drains), wait, and clean up. ``status``: process, /health, /ready.
With ``local.runtime: container`` the server is the image instead (infra/runtime/container.py):
the same weights, config and key file, mounted read-only; ``down`` is ``podman stop``. Both
runtimes start, wait for and drain the server through infra/runtime/; the state directory's
layout is infra/runtime/state.py.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.config import SECRET_MASK, StackConfig, StackFile, render_server_config
from infra.runtime.container import API_KEYS_MOUNT, MODELS_MOUNT, ServerContainer
from infra.runtime.podman import PodmanError
from infra.runtime.process import ServerProcess, alive, run_as, serves_config, stop_pid
from infra.runtime.state import checkout_of, container_name, local_paths

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0
LOG_TAIL_LINES = 30


NOBODY = 65534  # uid/gid the local server drops to when started by root


class LocalError(Exception):
    """A local deployment step failed; the message says which and why."""


@dataclass(frozen=True)
class Status:
    pid: int | None
    running: bool
    endpoint: str
    health: dict[str, Any] | None
    ready: dict[str, Any] | None

    @property
    def is_ready(self) -> bool:
        return bool(self.ready and self.ready.get("status") == "ready")


class LocalDeployment:
    def __init__(self, stack: StackFile) -> None:
        if stack.config.platform != "local":
            raise LocalError(f"stack {stack.name!r} is platform {stack.config.platform!r}; "
                             "use `pulumi up` for it (this command runs platform `local` stacks)")
        self.stack = stack
        self.config: StackConfig = stack.config
        self.root = checkout_of(stack)
        self.paths = local_paths(stack)
        self._process: subprocess.Popen[bytes] | None = None  # set when this object started the server
        self.container: ServerContainer | None = None
        if self.config.local.runtime == "container":
            self.container = ServerContainer(name=container_name(stack), image=self.config.local.image,
                                             drain_grace_s=self.config.service.drain_grace_s,
                                             port=self.config.service.port)

    # ---- URIs --------------------------------------------------------------------------------------

    def _absolute_uri(self, uri: str) -> str:
        """file://relative → file:///<checkout>/relative, so nothing depends on the working directory."""
        if uri.startswith("file://") and not uri.startswith("file:///"):
            return f"file://{self.root / uri.removeprefix('file://')}"
        return uri

    @property
    def endpoint(self) -> str:
        return f"http://{self.config.local.host}:{self.config.service.port}"

    # ---- up ----------------------------------------------------------------------------------------

    def up(self, target_dir: Path, draft_dir: Path | None, progress: Any = None) -> Status:
        current = self.status()
        if current.running:
            logger.info("already running (pid %s)", current.pid)
            return current
        self.paths.state_dir.mkdir(parents=True, exist_ok=True)
        target_local = self._publish_and_fetch("target", self.config.model.source, target_dir, progress)
        draft_local = None
        if self.config.uses_draft_model:
            assert self.config.draft is not None
            draft_local = self._publish_and_fetch("draft", self.config.draft.source, draft_dir, progress)
        self._write_api_keys()
        keys_file = str(self.paths.api_keys_file)
        if self.container is not None:  # the paths the server sees inside the container
            target_local = Path(MODELS_MOUNT) / target_local.relative_to(self.paths.models_dir)
            if draft_local is not None:
                draft_local = Path(MODELS_MOUNT) / draft_local.relative_to(self.paths.models_dir)
            keys_file = API_KEYS_MOUNT
        server_config = render_server_config(
            self.config,
            model_path=str(target_local),
            draft_path=str(draft_local) if draft_local else None,
            host=self.config.local.host,
            kv_cache_bytes=self.config.local.kv_cache_mb * 2**20,
            api_keys_file=keys_file,
        )
        self.paths.server_config.write_text(server_config.to_yaml())
        self._start_server()
        return self.wait_ready()

    def _publish_and_fetch(self, role: str, source: str, local_dir: Path | None, progress: Any) -> Path:
        from serving.weights import WeightsError, pull, push
        from serving.weights.transfer import make_readable

        uri = self._absolute_uri(source)
        try:
            if uri.startswith("file://") and local_dir is not None:
                if not (local_dir / "config.json").is_file():
                    raise LocalError(f"{role} model: {local_dir} has no config.json (is the demo pair built?)")
                push(local_dir, uri, progress=progress)
            target = self.paths.models_dir / role
            pull(uri, target, progress=progress)
            make_readable(target)  # a cache pulled before pulls set modes: the image's user must read it
        except WeightsError as exc:
            raise LocalError(f"{role} model: {exc}") from exc
        return target

    def _write_api_keys(self) -> None:
        configured = self.config.api_keys
        if configured and configured != SECRET_MASK:
            content = "\n".join(item.strip() for item in configured.split(",") if item.strip()) + "\n"
        elif self.paths.api_keys_file.is_file():
            return  # keep the key generated by an earlier `up`
        else:
            content = f"local:sk-local-{secrets.token_urlsafe(24)}\n"
        fd = os.open(self.paths.api_keys_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(content)

    def api_key(self) -> str | None:
        """The first key in the local key file (for the printed example)."""
        return self.paths.api_key()

    def _start_server(self) -> None:
        if self.container is not None:
            try:
                pid = self.container.start(self.paths.models_dir, self.paths.server_config,
                                           self.paths.api_keys_file, self.paths.log_file)
            except PodmanError as exc:
                raise LocalError(str(exc)) from exc
            self.paths.pid_file.write_text(f"{pid}\n")
            logger.info("server container %s started (pid %d), log %s", self.container.name, pid, self.paths.log_file)
            return
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEPLOY")}
        env["SPECDEPLOY_ENV"] = "production"
        env["PYTHONUNBUFFERED"] = "1"
        wrapper: list[str] = []
        if os.geteuid() == 0 and shutil.which("setpriv"):
            # Never serve as root, even locally (the launch checks fail a root server). The state dir
            # stays root's: the unprivileged server keeps only the right to read it (the interpreter
            # may also live under root's private home), and writes nothing there.
            wrapper = run_as(NOBODY, NOBODY, read_anywhere=True)
        server = ServerProcess(self.paths.server_config, self.config.service.port, env, self.paths.log_file,
                               host=self.config.local.host, cwd=self.root, wrapper=wrapper,
                               detach=True)  # survives this command; `down` stops it
        proc = server.spawn()
        self._process = proc
        self.paths.pid_file.write_text(f"{proc.pid}\n")
        logger.info("server started (pid %d), log %s", proc.pid, self.paths.log_file)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> Status:
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.status()
            if status.is_ready:
                return status
            if not status.running:
                code = self._process.poll() if self._process is not None else None
                raise LocalError(f"server (pid file {self.paths.pid_file}: {self._pid_text()}) is not running "
                                 f"(exit code {code}); log {self.paths.log_file}:\n{self.log_tail()}")
            reason = (status.ready or {}).get("reason", "")
            if (status.ready or {}).get("failed"):
                self.down()
                raise LocalError(f"server refused readiness: {reason}")
            if time.monotonic() > deadline:
                raise LocalError(f"server not ready after {timeout_s:.0f}s ({reason or 'no answer'}); "
                                 f"log {self.paths.log_file}:\n{self.log_tail()}")
            time.sleep(0.25)

    # ---- down / status -----------------------------------------------------------------------------

    def down(self, timeout_s: float | None = None) -> bool:
        """SIGTERM, wait for the drain, SIGKILL as a last resort. False when nothing was running."""
        if self.container is not None:
            code = self.container.stop()
            self.paths.pid_file.unlink(missing_ok=True)
            if code not in (None, 0):
                logger.warning("server container %s exited with code %s", self.container.name, code)
            return code is not None
        pid = self._live_pid()
        if pid is None:
            self.paths.pid_file.unlink(missing_ok=True)
            return False
        stop_pid(pid, timeout_s if timeout_s is not None else self.config.service.drain_grace_s + 15)
        self.paths.pid_file.unlink(missing_ok=True)
        return True

    def status(self) -> Status:
        pid = self._live_pid()
        health = ready = None
        if pid is not None:
            health = _get_json(f"{self.endpoint}/health")
            ready = _get_json(f"{self.endpoint}/ready")
        return Status(pid=pid, running=pid is not None, endpoint=self.endpoint, health=health, ready=ready)

    def _live_pid(self) -> int | None:
        if self.container is not None:
            return self.container.state().pid
        try:
            pid = int(self.paths.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        if self._process is not None and self._process.pid == pid:  # started by this object
            return pid if self._process.poll() is None else None
        if not alive(pid) or not serves_config(pid, self.paths.server_config):
            return None
        return pid

    def _pid_text(self) -> str:
        try:
            return self.paths.pid_file.read_text().strip()
        except OSError:
            return "missing"

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            return "\n".join(self.paths.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _get_json(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            body: dict[str, Any] = json.loads(response.read())
            return body
    except urllib.error.HTTPError as exc:
        try:
            error_body: dict[str, Any] = json.loads(exc.read())
            return error_body
        except ValueError:
            return None
    except (OSError, ValueError):
        return None
