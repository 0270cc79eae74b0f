"""Facts about a serving host read through a testinfra backend (local://, ssh://, kubectl://, ...).

Only /proc and a POSIX shell are assumed: the server image has neither ss nor ps. A listening
socket is found in /proc/net/tcp{,6}, its owner process by the fd that links to socket:[inode].
Reading another user's /proc/<pid>/fd needs root on the host (testinfra's --sudo).
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Listener:
    address: str  # as ss prints it: 127.0.0.1, 0.0.0.0, [::], [::1]
    port: int
    uid: int  # owner of the socket: the user the listening process ran as
    inode: int  # the process holds an fd linking to socket:[inode]


def _hex_address(raw: str) -> str:
    data = bytes.fromhex(raw)
    if len(data) == 4:  # one little-endian word
        return socket.inet_ntop(socket.AF_INET, data[::-1])
    words = b"".join(data[i:i + 4][::-1] for i in range(0, 16, 4))
    if words[:12] == b"\0" * 10 + b"\xff\xff":  # IPv4-mapped IPv6
        return socket.inet_ntop(socket.AF_INET, words[12:])
    return f"[{socket.inet_ntop(socket.AF_INET6, words)}]"


def parse_proc_net_tcp(text: str) -> list[Listener]:
    """Listening sockets in the text of /proc/net/tcp and /proc/net/tcp6 (state 0A = LISTEN)."""
    found = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 10 or fields[3] != "0A" or ":" not in fields[1]:
            continue
        address, port = fields[1].rsplit(":", 1)
        found.append(Listener(_hex_address(address), int(port, 16), int(fields[7]), int(fields[9])))
    return found


def listeners(host: Any, port: int | None = None) -> list[Listener]:
    text = host.run("cat /proc/net/tcp /proc/net/tcp6 2>/dev/null").stdout
    return [entry for entry in parse_proc_net_tcp(text) if port is None or entry.port == port]


def socket_owner_pids(host: Any, inodes: set[int]) -> set[int]:
    """Processes holding any of these socket inodes."""
    if not inodes:
        return set()
    # One ls over every process: its output names each fd directory ("/proc/123/fd:") before the links.
    out = host.run("ls -l /proc/[0-9]*/fd 2>/dev/null").stdout
    pids: set[int] = set()
    current: int | None = None
    for line in out.splitlines():
        header = re.match(r"^/proc/(\d+)/fd:$", line)
        if header:
            current = int(header.group(1))
            continue
        link = re.search(r"socket:\[(\d+)\]", line)
        if link and current is not None and int(link.group(1)) in inodes:
            pids.add(current)
    return pids


def socket_inodes(host: Any, pid: int) -> set[int]:
    out = host.run(f"ls -l /proc/{pid}/fd 2>/dev/null").stdout
    return {int(i) for i in re.findall(r"socket:\[(\d+)\]", out)}


def server_pid(host: Any, port: int) -> int | None:
    """The one process listening on ``port``; None when there is none or it cannot be told."""
    pids = socket_owner_pids(host, {entry.inode for entry in listeners(host, port)})
    return pids.pop() if len(pids) == 1 else None


def process_uid(host: Any, pid: int) -> int | None:
    status = host.file(f"/proc/{pid}/status")
    match = re.search(r"^Uid:\s+(\d+)", status.content_string, re.M) if status.exists else None
    return int(match.group(1)) if match else None


def process_argv(host: Any, pid: int) -> list[str]:
    return [part.decode("utf-8", "replace") for part in host.file(f"/proc/{pid}/cmdline").content.split(b"\0")
            if part]


def process_environ(host: Any, pid: int) -> dict[str, str]:
    pairs = (p.decode("utf-8", "replace").partition("=") for p in host.file(f"/proc/{pid}/environ").content.split(b"\0")
             if p)
    return {key: value for key, _, value in pairs}


_SECRET_PATTERNS = {
    "AWS access key id": re.compile(r"\bA(KIA|SIA)[0-9A-Z]{16}\b"),
    "AWS secret access key": re.compile(r"aws_secret_access_key\s*[:=]\s*\S{20,}", re.I),
    "private key": re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    "API key entry (id:key)": re.compile(r"^\s*[\w.-]+:[A-Za-z0-9_\-]{16,}(:\d+)?\s*$", re.M),
    "password, token or key value": re.compile(
        r"\b(password|passwd|token|secret|api_?keys?)\b\s*[:=]\s*['\"]?[^\s'\"$]{8,}", re.I),
}


def plaintext_secrets(text: str) -> list[str]:
    """What kinds of secret a config file's text holds in plain text (names only, never the values)."""
    return [what for what, pattern in _SECRET_PATTERNS.items() if pattern.search(text)]


def oom_kills(host: Any, pid: int) -> int | None:
    """OOM kills so far in the memory cgroup of process ``pid`` (cgroup v2 memory.events or v1
    memory.oom_control); None where neither is readable. A rise during a run means the kernel
    killed something in the server's container: the server itself or a worker of it."""
    cgroups = host.file(f"/proc/{pid}/cgroup")
    if not cgroups.exists:
        return None
    candidates = []
    for line in cgroups.content_string.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            candidates.append(f"/sys/fs/cgroup{path.rstrip('/')}/memory.events")
        elif "memory" in controllers.split(","):
            candidates.append(f"/sys/fs/cgroup/memory{path.rstrip('/')}/memory.oom_control")
    for name in candidates:
        file = host.file(name)
        if file.exists:
            match = re.search(r"^oom_kill (\d+)", file.content_string, re.M)
            if match:
                return int(match.group(1))
    return None
