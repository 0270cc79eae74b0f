"""KubeApi reads a kubeconfig like kubectl: current context, token, client certificate, exec plugins."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest
import yaml

from infra.ops.release.kubernetes import KubeApi
from infra.ops.release.model import ReleaseError


def write_kubeconfig(path: Path, user: dict[str, object], context: str = "prod") -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": context,
        "clusters": [{"name": "c", "cluster": {"server": "https://10.0.0.1:6443", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "prod", "context": {"cluster": "c", "user": "u"}},
                     {"name": "other", "context": {"cluster": "c", "user": "u"}}],
    }))
    return path


def test_token_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    api = KubeApi.from_environment(write_kubeconfig(tmp_path / "config", {"token": "abc"}))
    assert (api.server, api.token) == ("https://10.0.0.1:6443", "abc")


def test_exec_plugin_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As `aws eks get-token` does: the plugin prints an ExecCredential."""
    plugin = tmp_path / "get-token"
    credential = {"kind": "ExecCredential", "status": {"token": "from-plugin"}}
    plugin.write_text(f"#!{sys.executable}\nimport json; print(json.dumps({credential!r}))\n")
    plugin.chmod(plugin.stat().st_mode | stat.S_IEXEC)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    api = KubeApi.from_environment(write_kubeconfig(tmp_path / "config", {"exec": {"command": str(plugin)}}))
    assert api.token == "from-plugin"


def test_missing_context_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    path = write_kubeconfig(tmp_path / "config", {"token": "abc"})
    with pytest.raises(ReleaseError, match="no context named 'staging'"):
        KubeApi.from_environment(path, "staging")


def test_no_kubeconfig_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ReleaseError, match="no kubeconfig"):
        KubeApi.from_environment(tmp_path / "absent")


def test_client_certificate_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import base64
    import glob
    import shutil
    import subprocess
    import tempfile

    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a client certificate")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=operator", "-days", "1",
                    "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem")],
                   check=True, capture_output=True)
    user = {f"client-{kind}-data": base64.b64encode((tmp_path / f"{kind[:4]}.pem").read_bytes()).decode()
            for kind in ("certificate", "key")}
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    before = set(glob.glob(f"{tempfile.gettempdir()}/specdeploy-kube-*"))
    api = KubeApi.from_environment(write_kubeconfig(tmp_path / "config", user))
    assert api.token is None and api.context is not None
    assert set(glob.glob(f"{tempfile.gettempdir()}/specdeploy-kube-*")) == before  # key material not left behind
