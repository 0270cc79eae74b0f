"""The rendered user-data: valid bash, the image's own `python -m serving.weights pull`, the stack's server config."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pulumi
import pytest
import yaml

from infra.components.aws.user_data import (
    TEMPLATES,
    USER_DATA_LIMIT,
    UserDataSpec,
    decode_user_data,
    encode_user_data,
    render_cloudwatch_agent_config,
    render_prometheus_config,
    render_user_data,
)
from infra.config import load_stack, render_server_config
from infra.program.preview import PreviewResult
from serving import metric_names as m
from serving.config import ServerConfig
from serving.weights.__main__ import build_parser as weights_parser

StackFn = Callable[[str], PreviewResult]
STACKS = ("dev", "staging", "prod")
SPEC = UserDataSpec(
    stack="unit", slot="green", region="us-east-1",
    image="123456789012.dkr.ecr.us-east-1.amazonaws.com/specdeploy-server@sha256:" + "a" * 64,
    model_uri="s3://models/target/v1", draft_uri="s3://models/draft/v1", model_dir="/data/models/target",
    draft_dir="/data/models/draft", cache_dir="/data/models", server_config_yaml="service: {}\n",
    secret_id="specdeploy/unit/api-keys", log_group="/specdeploy/unit/green/server",
    prometheus_log_group="/specdeploy/unit/green/metrics", port=8000, drain_grace_s=30, ready_timeout_s=900,
)


def _script(result: PreviewResult) -> str:
    return decode_user_data(result.single("aws:ec2/launchTemplate:LaunchTemplate").inputs["userData"])


def _bash_n(script: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "user-data.sh"
    path.write_text(script)
    return subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)


def _heredoc(script: str, delimiter: str) -> str:
    match = re.search(rf"<<'{delimiter}'\n(.*?)^{delimiter}$", script, re.S | re.M)
    assert match, delimiter
    return match.group(1)


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_user_data_is_valid_bash(stack: str, aws_stack: StackFn, tmp_path: Path) -> None:
    result = _bash_n(_script(aws_stack(stack)), tmp_path)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("variant", [
    {"driver_min": "550.54.15"}, {"metrics_require_auth": True}, {"draft_uri": None, "draft_dir": None},
])
def test_every_template_branch_is_valid_bash(variant: dict[str, object], tmp_path: Path) -> None:
    result = _bash_n(render_user_data(replace(SPEC, **variant)), tmp_path)  # type: ignore[arg-type]
    assert result.returncode == 0, result.stderr


def test_weight_pull_is_the_images_own_weights_pull_command(tmp_path: Path) -> None:
    # Run the script's own pull function with a fake `docker` that prints what it was asked to run.
    script = render_user_data(SPEC)
    function = re.search(r"^pull_weights\(\) \{\n.*?^\}$", script, re.S | re.M)
    assert function
    fake = tmp_path / "docker"
    fake.write_text('#!/bin/bash\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    run = subprocess.run(
        ["bash", "-c", f"IMAGE=img\n{function.group(0)}\npull_weights s3://models/target/v1 /data/models/target"],
        capture_output=True, text=True, env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}, check=True)
    argv = run.stdout.splitlines()
    entrypoint = argv[argv.index("--entrypoint") + 1]
    command = argv[argv.index("img") + 1:]
    assert [entrypoint, *command] == ["python3", "-m", "serving.weights", "pull", "s3://models/target/v1",
                                      "/data/models/target"]
    parsed = weights_parser().parse_args(command[2:])  # what the image's `python3 -m serving.weights` parses
    assert (parsed.command, parsed.uri, str(parsed.directory)) == ("pull", "s3://models/target/v1",
                                                                   "/data/models/target")


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_both_versions_of_the_slot_are_pulled_and_verified(stack: str, aws_stack: StackFn) -> None:
    slot = load_stack(stack).config.slots.blue
    assert slot is not None
    script = _script(aws_stack(stack))
    assert f"MODEL_URI={slot.model_version}" in script and f"DRAFT_URI={slot.draft_version}" in script
    assert 'pull_weights "$MODEL_URI" "$MODEL_DIR"' in script and 'pull_weights "$DRAFT_URI" "$DRAFT_DIR"' in script


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_server_config_is_rendered_from_the_stack(stack: str, aws_stack: StackFn) -> None:
    written = yaml.safe_load(_heredoc(_script(aws_stack(stack)), "SPECDEPLOY_SERVER_CONFIG"))
    expected = render_server_config(load_stack(stack).config, api_keys_file="/etc/specdeploy/secrets/api_keys")
    assert ServerConfig.model_validate(written) == expected


def test_script_checks_the_driver_and_the_gpu_in_the_container() -> None:
    script = render_user_data(replace(SPEC, driver_min="550.54.15"))
    assert "nvidia-smi --query-gpu" in script and "--gpus all --entrypoint python" in script
    assert "torch.cuda.is_available()" in script  # torch in the image, not only nvidia-smi, must see the GPU
    assert "DRIVER_MIN=550.54.15" in script


def test_script_uses_only_imds_v2() -> None:
    script = render_user_data(SPEC)
    assert "X-aws-ec2-metadata-token-ttl-seconds" in script
    assert all("X-aws-ec2-metadata-token" in line for line in script.splitlines() if "169.254.169.254" in line)


def test_cache_and_secrets_belong_to_the_images_user() -> None:
    dockerfile = (Path(__file__).resolve().parents[2] / "serving" / "Dockerfile").read_text()
    uid = re.search(r"^USER (\d+)", dockerfile, re.M)
    assert uid and SPEC.server_uid == int(uid.group(1))
    script = render_user_data(SPEC)
    assert f"install -d -m 0755 -o {uid.group(1)} -g {uid.group(1)} /data/models" in script
    assert f"chown -R {uid.group(1)}:{uid.group(1)} /etc/specdeploy/secrets" in script


def test_script_waits_for_ready() -> None:
    assert 'curl -fsS "http://127.0.0.1:$PORT/ready"' in render_user_data(SPEC)


def test_api_keys_are_read_from_secrets_manager_at_boot() -> None:
    script = render_user_data(SPEC)
    assert "aws secretsmanager get-secret-value" in script and "--secret-id specdeploy/unit/api-keys" in script
    assert "set -x" not in script


def test_systemd_unit_runs_the_image_with_the_rendered_config() -> None:
    unit = render_user_data(SPEC).split("cat > /etc/systemd/system/specdeploy.service")[1]
    assert "--env SPECDEPLOY_CONFIG=/etc/specdeploy/server.yaml" in unit and "--gpus all" in unit
    assert "TimeoutStopSec=50" in unit  # drain 30 s + docker stop slack + systemd slack


def test_cloudwatch_agent_publishes_gpu_metrics_and_the_queue_gauge() -> None:
    config = json.loads(render_cloudwatch_agent_config(SPEC))
    selectors = config["logs"]["metrics_collected"]["prometheus"]["emf_processor"]["metric_declaration"][0][
        "metric_selectors"]
    assert "nvidia_gpu" in config["metrics"]["metrics_collected"] and f"^{m.WAITING}$" in selectors


def test_prometheus_scrape_labels_carry_the_group() -> None:
    scrape = yaml.safe_load(render_prometheus_config(SPEC))["scrape_configs"][0]
    assert scrape["static_configs"][0]["labels"]["AutoScalingGroupName"] == "__ASG_NAME__"


def test_user_data_ships_gzipped_within_the_ec2_limit() -> None:
    encoded = encode_user_data(render_user_data(SPEC))
    assert len(base64.b64decode(encoded)) <= USER_DATA_LIMIT and decode_user_data(encoded) == render_user_data(SPEC)


def test_histogram_publisher_is_installed_verbatim() -> None:
    installed = _heredoc(render_user_data(SPEC), "SPECDEPLOY_PUBLISHER")
    assert installed == (TEMPLATES / "publish_histograms.py").read_text()
