"""2. Host: what the serving machine itself must look like (testinfra; --hosts, default local://).

Guide: 四.3/五.2 (weights hash-checked), 四.4 (listen on the internal address only, least
privilege, no keys in config files), 五.1 (GPU visible, driver version right), 九 (weight cache).
"""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from infra.runtime.process import config_path_of
from infra.validation import hostfacts
from serving.config import TOKEN_MAP_NAME

pytestmark = pytest.mark.launch

_CONFIG_SUFFIXES = (".yaml", ".yml", ".json", ".toml", ".ini", ".conf", ".cfg", ".env")


def _server_pid(host: Any, port: int) -> int:
    found = hostfacts.listeners(host, port)
    assert found, f"nothing listens on port {port}"
    pid = hostfacts.server_pid(host, port)
    assert pid is not None, f"cannot tell which process listens on port {port} (host checks need root: --sudo)"
    return pid


def _server_config(host: Any, port: int) -> tuple[str, dict[str, Any]]:
    """Path and content of the config file the server process was started with."""
    pid = _server_pid(host, port)
    cwd = Path(host.file(f"/proc/{pid}/cwd").linked_to)
    path = config_path_of(hostfacts.process_argv(host, pid), hostfacts.process_environ(host, pid), cwd)
    if path is None:
        pytest.skip(f"server process {pid} names no --config / SPECDEPLOY_CONFIG")
    return str(path), yaml.safe_load(host.file(str(path)).content_string) or {}


def _model_dir(host: Any, port: int, options: Any, role: str) -> str:
    if options.model_dir and role == "target":
        return str(options.model_dir)
    _, config = _server_config(host, port)
    directory = config["model"]["path"] if role == "target" else (config.get("speculative") or {}).get("draft_model")
    if not directory:
        pytest.skip(f"the server runs without a {role} model")
    return str(directory)


def _manifest(host: Any, directory: str) -> dict[str, Any]:
    manifest = host.file(f"{directory}/manifest.json")
    assert manifest.exists, f"{directory}/manifest.json is missing: weights were not pulled through the store"
    return dict(json.loads(manifest.content_string))


def test_server_process_is_running(host: Any, server_port: int) -> None:
    pid = _server_pid(host, server_port)
    assert host.file(f"/proc/{pid}/status").exists


def test_server_process_does_not_run_as_root(host: Any, server_port: int) -> None:
    pid = _server_pid(host, server_port)
    uid = hostfacts.process_uid(host, pid)
    assert uid is not None and uid != 0, f"server process {pid} runs as root"


def test_server_listens_only_on_the_configured_address(host: Any, server_port: int, listen_address: str) -> None:
    inodes = hostfacts.socket_inodes(host, _server_pid(host, server_port))
    sockets = {(e.address, e.port) for e in hostfacts.listeners(host) if e.inode in inodes}
    allowed = {(listen_address, server_port)}
    if listen_address == "0.0.0.0":
        allowed |= {("*", server_port), ("[::]", server_port)}
    assert sockets and sockets <= allowed, f"server listens on {sorted(sockets)}; allowed {sorted(allowed)}"


def test_model_files_match_the_manifest(host: Any, server_port: int, options: Any, model_role: str) -> None:
    directory = _model_dir(host, server_port, options, model_role)
    manifest = _manifest(host, directory)
    mismatched = []
    for entry in manifest["files"]:
        file = host.file(f"{directory}/{entry['path']}")
        if not file.exists or file.size != entry["size"] or file.sha256sum != entry["sha256"]:
            mismatched.append(entry["path"])
    assert not mismatched, f"{directory}: files differ from manifest.json: {mismatched}"


def test_the_drafts_token_map_came_with_its_verified_weights(host: Any, server_port: int) -> None:
    """speculative.draft_token_map names a file in the draft's directory (auto: its token_map.json, where there is
    one): it must be one of the files the draft's manifest lists (pushed and pulled with the weights, checked
    above), not one copied in beside them."""
    _, config = _server_config(host, server_port)
    spec = config.get("speculative") or {}
    name, draft = spec.get("draft_token_map"), spec.get("draft_model")
    if name == "auto" and draft:  # the engine takes the draft's conventional map where there is one
        name = TOKEN_MAP_NAME if host.file(f"{draft}/{TOKEN_MAP_NAME}").exists else None
    if not (spec.get("enabled") and draft and name):
        pytest.skip("the server's draft proposes from its whole vocabulary (no speculative.draft_token_map)")
    listed = {entry["path"] for entry in _manifest(host, draft)["files"]}
    assert name in listed, f"{draft}/{name} is not in the draft's manifest.json ({len(listed)} files)"


def test_gpu_is_visible_with_a_supported_driver(host: Any, stack: Any) -> None:
    if not host.exists("nvidia-smi"):
        pytest.skip("CPU host: no nvidia-smi (GPU checks apply to GPU instances)")
    result = host.run("nvidia-smi --query-gpu=name,driver_version --format=csv,noheader")
    assert result.rc == 0 and result.stdout.strip(), f"nvidia-smi failed: {result.stderr.strip()}"
    minimum = stack.fleet.nvidia_driver_min
    if minimum:
        driver = result.stdout.strip().splitlines()[0].split(",")[-1].strip()
        as_tuple = tuple(int(p) for p in re.findall(r"\d+", driver))
        assert as_tuple >= tuple(int(p) for p in re.findall(r"\d+", minimum)), f"driver {driver} < {minimum}"


def test_free_disk_holds_another_model_version(host: Any, server_port: int, options: Any) -> None:
    directory = _model_dir(host, server_port, options, "target")
    needed = sum(e["size"] for e in _manifest(host, directory)["files"])
    _, config = _server_config(host, server_port)
    draft = (config.get("speculative") or {}).get("draft_model")
    if draft and host.file(f"{draft}/manifest.json").exists:
        needed += sum(e["size"] for e in _manifest(host, draft)["files"])
    available = int(host.run(f"df -PB1 {directory} | tail -1 | awk '{{print $4}}'").stdout.strip())
    assert available >= needed, f"{available} bytes free next to the weight cache; a new version needs {needed}"


def test_no_plaintext_secrets_in_config_files(host: Any, server_port: int, api_key: str | None) -> None:
    path, config = _server_config(host, server_port)
    keys_file = (config.get("service") or {}).get("api_keys_file")
    folder = str(PurePosixPath(path).parent)
    listing = host.run(f"find {folder} -maxdepth 1 -type f").stdout.split()
    files = sorted({path, *(f for f in listing if f.endswith(_CONFIG_SUFFIXES) and f != keys_file)})
    found = []
    for name in files:
        text = host.file(name).content_string
        found += [f"{name}: {what}" for what in hostfacts.plaintext_secrets(text)]
        if api_key and api_key in text:
            found.append(f"{name}: the API key itself")
    assert not found, "plaintext secrets: " + "; ".join(found)


def test_api_key_file_is_not_readable_by_others(host: Any, server_port: int) -> None:
    _, config = _server_config(host, server_port)
    keys_file = (config.get("service") or {}).get("api_keys_file")
    if not keys_file:
        pytest.skip("keys come from the environment, not a file")
    assert host.file(keys_file).mode & 0o077 == 0, f"{keys_file} is readable by group or others"
