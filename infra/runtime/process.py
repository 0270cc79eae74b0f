"""Server processes on this machine: start one, wait for /ready, drain it, stop it by pid.

One runtime for every `specdeploy serve` started here: the local platform's server (infra/ops/local.py,
detached, it outlives the command), the launch checks' speculative twin (infra/validation/twin.py), the
HTTP benchmark's servers. The container runtime (infra/runtime/container.py) is the same idea under podman.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from serving.net import NotReady, wait_until_ready

logger = logging.getLogger(__name__)


def config_path_of(cmdline: Sequence[str], environ: Mapping[str, str], cwd: Path | None = None) -> Path | None:
    """The server config file a `specdeploy serve` process was started with (--config or env)."""
    value: str | None = None
    for index, arg in enumerate(cmdline):
        if arg == "--config" and index + 1 < len(cmdline):
            value = cmdline[index + 1]
        elif arg.startswith("--config="):
            value = arg.split("=", 1)[1]
    value = value or environ.get("SPECDEPLOY_CONFIG")
    if value is None:
        return None
    path = Path(value)
    return path if path.is_absolute() or cwd is None else cwd / path


class ServerProcess:
    """A `specdeploy serve` process started here; ``stop()`` drains it with SIGTERM, then kills.

    ``detach``: the process gets its own session and no stdin, so it outlives the command that
    started it (the local platform's server; `specdeploy down` stops it by pid, :func:`stop_pid`)."""

    def __init__(self, config_path: Path, port: int, env: Mapping[str, str], log_path: Path,
                 host: str = "127.0.0.1", cwd: Path | None = None, wrapper: Sequence[str] = (),
                 detach: bool = False) -> None:
        self.config_path = config_path
        self.port = port
        self.host = host
        self.env = dict(env)
        self.log_path = log_path
        self.cwd = cwd
        self.wrapper = list(wrapper)  # command prefix, e.g. setpriv to run as another user
        self.detach = detach
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def command(self) -> list[str]:
        return [*self.wrapper, sys.executable, "-m", "infra.ops.cli.main", "serve", "--config",
                str(self.config_path), "--host", self.host, "--port", str(self.port)]

    def spawn(self) -> subprocess.Popen[bytes]:
        """Start the process, its output appended to the log; returns at once."""
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            cwd=self.cwd, stdin=subprocess.DEVNULL if self.detach else None,
                                            start_new_session=self.detach)
        return self.process

    def start(self, ready_timeout_s: float = 180) -> ServerProcess:
        """Spawn, then wait for /ready; on failure stop it and raise with the log's tail."""
        process = self.spawn()
        wait_ready_or_raise(self.endpoint, ready_timeout_s, self.log_path, self.stop, process)
        return self

    def stop(self, grace_s: float = 20) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_ready_or_raise(endpoint: str, timeout_s: float, log_path: Path, stop: Callable[[], object],
                        process: subprocess.Popen[bytes] | None = None, what: str = "server") -> None:
    """Wait for ``endpoint``'s /ready; when it does not come, ``stop()`` the server and raise a
    RuntimeError carrying the tail of its log."""
    try:
        wait_until_ready(endpoint, timeout_s, process)
    except NotReady as exc:
        stop()
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-2000:] if log_path.is_file() else ""
        raise RuntimeError(f"{what}: {exc}\n--- its log ---\n{tail}") from exc


def stop_pid(pid: int, grace_s: float) -> None:
    """SIGTERM ``pid`` (the server drains), wait up to ``grace_s``, SIGKILL as a last resort."""
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(pid):
        logger.warning("server (pid %d) still running after %.0fs: killing it", pid, grace_s)
        os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)  # reap it if it is our own exited child
        if waited == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def serves_config(pid: int, config_path: Path) -> bool:
    """Guard against a recycled pid: the process must be `serve` with ``config_path``."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return True  # no /proc (macOS): trust the pid file
    return b"serve" in cmdline and str(config_path).encode() in cmdline


def run_as(uid: int, gid: int, read_anywhere: bool = False) -> list[str]:
    """A setpriv prefix that runs a command as ``uid``:``gid`` (needs root). ``read_anywhere`` keeps
    CAP_DAC_READ_SEARCH, for machines whose interpreter lives under a private home (e.g. /root)."""
    prefix = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
    if read_anywhere:
        prefix += ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    return [*prefix, "--"]
