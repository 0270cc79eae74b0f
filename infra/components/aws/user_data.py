"""User-data of a serving instance, rendered from infra/components/aws/templates with jinja2.

One function per rendered file. Everything here is a plain string built from the
stack config: the user-data carries names and URIs, never a secret value (the API
keys are fetched from Secrets Manager at boot), so it can be diffed in review and
scanned by the policy pack. The weight pull line is exactly the `python -m serving.weights
pull URI DIR` command of serving/weights/__main__.py, run with the server image.
"""

from __future__ import annotations

import base64
import gzip
import json
import shlex
from dataclasses import dataclass
from pathlib import Path

import jinja2

from infra.components.aws.common import METRIC_NAMESPACE
from serving import metric_names as m

TEMPLATES = Path(__file__).resolve().parent / "templates"
WEIGHTS_PULL = "serving.weights pull"  # `python3 -m serving.weights pull URI DIR`, inside the server image
CONFIG_DIR = "/etc/specdeploy"
# Launch lifecycle hook the group holds new instances in until user-data sees /ready (gpu_fleet.py).
LAUNCH_HOOK = "specdeploy-ready"
SECRETS_DIR = f"{CONFIG_DIR}/secrets"
# Gauges the CloudWatch agent publishes from /metrics (histograms go through publish_histograms.py).
PUBLISHED_GAUGES = (m.WAITING, m.RUNNING, m.READY, m.GPU_MEMORY_USED, m.GPU_MEMORY_TOTAL, m.GPU_UTILIZATION,
                    m.KV_BLOCKS_USED, m.KV_BLOCKS_TOTAL)
PUBLISHED_HISTOGRAMS = (m.TTFT, m.E2E)


@dataclass(frozen=True)
class UserDataSpec:
    stack: str
    slot: str
    region: str
    image: str  # by digest
    model_uri: str
    draft_uri: str | None
    model_dir: str
    draft_dir: str | None
    cache_dir: str
    server_config_yaml: str
    secret_id: str  # ARN (or name) of the Secrets Manager secret with the API keys
    log_group: str
    prometheus_log_group: str
    port: int
    drain_grace_s: float
    ready_timeout_s: int
    driver_min: str | None = None
    metrics_require_auth: bool = False
    log_retention_days: int = 30
    server_uid: int = 10001  # USER of serving/Dockerfile: owns the weight cache and reads the secrets

    @classmethod
    def log_groups(cls, stack: str, slot: str) -> tuple[str, str]:
        """(server logs, agent's Prometheus EMF) log groups of one slot."""
        return f"/specdeploy/{stack}/{slot}/server", f"/specdeploy/{stack}/{slot}/metrics"

    @property
    def registry(self) -> str:
        return self.image.split("/", 1)[0]


# EC2 accepts at most 16 KiB of user-data; cloud-init unpacks gzip, so the script ships compressed.
USER_DATA_LIMIT = 16 * 1024


def encode_user_data(script: str) -> str:
    """Base64 of the gzipped script (mtime 0: the same script always gives the same bytes, no diff)."""
    packed = gzip.compress(script.encode(), mtime=0)
    if len(packed) > USER_DATA_LIMIT:
        raise ValueError(f"user-data is {len(packed)} bytes compressed; EC2 accepts {USER_DATA_LIMIT}")
    return base64.b64encode(packed).decode()


def decode_user_data(encoded: str) -> str:
    """The script inside launch-template user-data (base64, gzipped or not)."""
    raw = base64.b64decode(encoded)
    return (gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw).decode("utf-8", errors="replace")


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,  # noqa: S701 - shell, JSON and YAML, not HTML
    )
    env.filters["shq"] = lambda value: shlex.quote(str(value))
    return env


def _with_newline(text: str) -> str:
    return text if text.endswith("\n") else text + "\n"


def render_prometheus_config(spec: UserDataSpec) -> str:
    return _environment().get_template("prometheus.yaml.j2").render(
        port=spec.port, metrics_key_file=f"{SECRETS_DIR}/metrics_key" if spec.metrics_require_auth else None,
    )


def render_cloudwatch_agent_config(spec: UserDataSpec) -> str:
    text = _environment().get_template("cloudwatch_agent.json.j2").render(
        namespace=METRIC_NAMESPACE, log_group=spec.log_group, prometheus_log_group=spec.prometheus_log_group,
        retention_days=spec.log_retention_days, gauges=PUBLISHED_GAUGES,
    )
    return json.dumps(json.loads(text), indent=2)  # fails here, not at boot, if the template breaks JSON


def render_user_data(spec: UserDataSpec) -> str:
    return _environment().get_template("user_data.sh.j2").render(
        stack=spec.stack,
        slot=spec.slot,
        region=spec.region,
        image=spec.image,
        registry=spec.registry,
        model_uri=spec.model_uri,
        model_dir=spec.model_dir,
        draft_uri=spec.draft_uri,
        draft_dir=spec.draft_dir,
        cache_dir=spec.cache_dir,
        port=spec.port,
        ready_timeout_s=spec.ready_timeout_s,
        driver_min=spec.driver_min,
        weights_pull=WEIGHTS_PULL,
        server_uid=spec.server_uid,
        secret_id=spec.secret_id,
        secrets_dir=SECRETS_DIR,
        api_keys_file=f"{SECRETS_DIR}/api_keys",
        metrics_key_file=f"{SECRETS_DIR}/metrics_key",
        metrics_require_auth=spec.metrics_require_auth,
        config_dir=CONFIG_DIR,
        server_config_file=f"{CONFIG_DIR}/server.yaml",
        server_config=_with_newline(spec.server_config_yaml),
        cloudwatch_agent_config=render_cloudwatch_agent_config(spec),
        prometheus_config=_with_newline(render_prometheus_config(spec)),
        histogram_publisher=_with_newline((TEMPLATES / "publish_histograms.py").read_text(encoding="utf-8")),
        metric_namespace=METRIC_NAMESPACE,
        log_group=spec.log_group,
        drain_grace_s=f"{spec.drain_grace_s:g}",
        launch_hook=LAUNCH_HOOK,
        stop_timeout_s=int(spec.drain_grace_s) + 5,
    )
