"""Server processes on this machine: find the one behind a port, start a twin of it, stop it.

The speculative A/B on a local stack compares the deployed server with a *twin*: the same config
file, the same environment (API keys included), the same host, differing only in
``SPECDEPLOY__SPECULATIVE__ENABLED`` and the port. The server has no runtime switch for
speculation, and a twin changes exactly one setting ("其他参数不变"), which a restart of the
deployed server with other flags could not promise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from serving.net import NotReady, free_port, wait_until_ready


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
    """A `specdeploy serve` process started here; ``stop()`` drains it with SIGTERM, then kills."""

    def __init__(self, config_path: Path, port: int, env: Mapping[str, str], log_path: Path,
                 host: str = "127.0.0.1", cwd: Path | None = None, wrapper: Sequence[str] = ()) -> None:
        self.config_path = config_path
        self.port = port
        self.host = host
        self.env = dict(env)
        self.log_path = log_path
        self.cwd = cwd
        self.wrapper = list(wrapper)  # command prefix, e.g. setpriv to run as another user
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self, ready_timeout_s: float = 180) -> ServerProcess:
        command = [*self.wrapper, sys.executable, "-m", "infra.ops.cli.main", "serve", "--config",
                   str(self.config_path), "--host", self.host, "--port", str(self.port)]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.cwd)
        try:
            wait_until_ready(self.endpoint, ready_timeout_s, self.process)
        except NotReady as exc:
            self.stop()
            tail = self.log_path.read_text(encoding="utf-8", errors="replace")[-2000:]
            raise RuntimeError(f"{exc}\n--- server log tail ---\n{tail}") from exc
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


class TwinUnavailable(RuntimeError):
    """The deployed server's config cannot run with the override (e.g. speculation on, no draft model)."""


def run_as(uid: int, gid: int, read_anywhere: bool = False) -> list[str]:
    """A setpriv prefix that runs a command as ``uid``:``gid`` (needs root). ``read_anywhere`` keeps
    CAP_DAC_READ_SEARCH, for machines whose interpreter lives under a private home (e.g. /root)."""
    prefix = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
    if read_anywhere:
        prefix += ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    return [*prefix, "--"]


_CAP_DAC_READ_SEARCH = 2


def start_twin(pid: int, overrides: Mapping[str, str], log_path: Path, ready_timeout_s: float = 180) -> ServerProcess:
    """Start a server with the config file and environment of process ``pid``, plus ``overrides``
    (``SPECDEPLOY__SECTION__KEY`` variables), on a free loopback port."""
    import testinfra

    from infra.validation import hostfacts

    host = testinfra.get_host("local://")
    cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
    environ = hostfacts.process_environ(host, pid)
    config = config_path_of(hostfacts.process_argv(host, pid), environ, cwd)
    if config is None:
        raise RuntimeError(f"process {pid} shows no --config or SPECDEPLOY_CONFIG; cannot start a twin of it")
    env = {**environ, **overrides}
    from serving.config import ConfigError, load_server_config

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
