"""`specdeploy image push`: the podman command lines, and the ECR side against moto_server.

Nothing is pushed anywhere real: a registry double stands in for `podman push` and stores the
manifest in moto's ECR (put_image), so the digest the command prints and pins is the one ECR lists.
"""

from __future__ import annotations

import base64
import json
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml

from infra.config import load_stack, project_stacks_dir
from infra.ops import image
from infra.ops.cli.main import main
from infra.ops.image import VARIANTS, BuildMounts, ImageError, PushTarget

REGION = "us-east-1"
ACCOUNT = "123456789012"  # moto's account


@pytest.fixture
def aws(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A reset moto account; boto3 clients built anywhere (the command too) talk to it."""
    urllib.request.urlopen(urllib.request.Request(f"{moto_endpoint}/moto-api/reset", method="POST")).close()
    for key, value in (("AWS_ENDPOINT_URL", moto_endpoint), ("AWS_ACCESS_KEY_ID", "testing"),
                       ("AWS_SECRET_ACCESS_KEY", "testing"), ("AWS_DEFAULT_REGION", REGION)):
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    yield boto3.client("ecr", region_name=REGION)


class RegistryDouble:
    """Stands in for podman: `login` records the password it got on stdin; `push` uploads a manifest
    to ECR (moto) and writes the digest podman would, to --digestfile."""

    def __init__(self, ecr: Any, digest_override: str | None = None) -> None:
        self.ecr = ecr
        self.calls: list[tuple[str, ...]] = []
        self.stdin: list[str | None] = []
        self.digest_override = digest_override

    def __call__(self, *args: str, stdin: str | None = None, **_: Any) -> str:
        self.calls.append(args)
        self.stdin.append(stdin)
        if args[0] == "push":
            destination = args[-1]
            repository, tag = destination.split("/", 1)[1].rsplit(":", 1)
            manifest = json.dumps({"schemaVersion": 2, "layers": [],
                                   "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                                   "config": {"digest": "sha256:" + "c" * 64, "size": 1}})
            stored = self.ecr.put_image(repositoryName=repository, imageManifest=manifest, imageTag=tag)
            digest = self.digest_override or stored["image"]["imageId"]["imageDigest"]
            Path(args[args.index("--digestfile") + 1]).write_text(digest + "\n")
        return ""


def _target(repository: str = "specdeploy-prod") -> PushTarget:
    return PushTarget(ACCOUNT, REGION, repository)


# ---- command lines -------------------------------------------------------------------------------------


def test_cuda_build_uses_nvidia_base_and_pytorch_cuda_wheels() -> None:
    mounts = BuildMounts(pip_conf=Path("/x/pip.conf"), volumes=("/x:/run/build-host/pip:ro",))
    cuda = image.build_args("localhost/specdeploy-server:cuda", VARIANTS["cuda"], mounts)
    cpu = image.build_args("localhost/specdeploy-server:cpu", VARIANTS["cpu"], mounts)
    assert "BASE_IMAGE=docker.io/nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04" in cuda
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126" in cuda
    assert f"BASE_IMAGE={image.BASE_IMAGE}" in cpu and "TORCH_INDEX_URL=" in cpu
    assert cuda[cuda.index("-t") + 1] == "localhost/specdeploy-server:cuda"
    assert cuda[-1] == str(image.REPO)


def test_login_takes_the_password_on_stdin_and_push_records_the_digest(tmp_path: Path) -> None:
    auth, digest = tmp_path / "auth.json", tmp_path / "digest"
    login = image.login_args(_target(), "AWS", auth)
    assert login == ["login", "--authfile", str(auth), "--username", "AWS", "--password-stdin",
                     f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com"]
    push = image.push_args("localhost/specdeploy-server:cuda", _target(), "cuda-1", auth, digest)
    assert push == ["push", "--authfile", str(auth), "--digestfile", str(digest), "localhost/specdeploy-server:cuda",
                    f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/specdeploy-prod:cuda-1"]


def test_remote_tags_differ_between_pushes() -> None:
    first, second = image.remote_tag(VARIANTS["cuda"], now=0), image.remote_tag(VARIANTS["cuda"], now=1)
    assert first.startswith("cuda-19700101T000000Z") and first != second


# ---- the ECR side (moto) -------------------------------------------------------------------------------


def test_missing_repository_says_to_run_pulumi_up_first(aws: Any) -> None:
    sts = boto3.client("sts", region_name=REGION)
    with pytest.raises(ImageError, match=r"'specdeploy-prod' does not exist .*`pulumi up --stack prod` first"):
        image.push_target(sts, aws, "prod", REGION, "specdeploy-prod")


def test_target_is_the_callers_account_in_the_stack_region(aws: Any) -> None:
    aws.create_repository(repositoryName="specdeploy-prod")
    target = image.push_target(boto3.client("sts", region_name=REGION), aws, "prod", REGION, "specdeploy-prod")
    assert target.uri == f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/specdeploy-prod"


def test_failing_credentials_are_named(aws: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    sts = boto3.session.Session().client("sts", region_name=REGION)
    with pytest.raises(ImageError, match="AWS credentials failed"):
        image.push_target(sts, aws, "prod", REGION, "specdeploy-prod")


def test_push_logs_in_with_the_ecr_token_and_returns_the_digest_ecr_lists(aws: Any) -> None:
    aws.create_repository(repositoryName="specdeploy-prod")
    registry = RegistryDouble(aws)
    pushed = image.push("localhost/specdeploy-server:cuda", _target(), aws, "cuda-1", run=registry,
                        exists=lambda _: True)
    token = aws.get_authorization_token()["authorizationData"][0]["authorizationToken"]
    user, password = base64.b64decode(token).decode().split(":", 1)
    assert registry.calls[0][registry.calls[0].index("--username") + 1] == user
    assert registry.stdin[0] == password and all(password not in arg for arg in registry.calls[0])
    listed = aws.describe_images(repositoryName="specdeploy-prod", imageIds=[{"imageTag": "cuda-1"}])
    assert pushed.image == f"{_target().uri}@{listed['imageDetails'][0]['imageDigest']}"


def test_a_digest_ecr_does_not_list_is_an_error(aws: Any) -> None:
    aws.create_repository(repositoryName="specdeploy-prod")
    registry = RegistryDouble(aws, digest_override="sha256:" + "0" * 64)
    with pytest.raises(ImageError, match="ECR does not list it"):
        image.push("localhost/specdeploy-server:cuda", _target(), aws, "cuda-1", run=registry, exists=lambda _: True)


def test_an_image_not_built_is_named_before_anything_is_pushed(aws: Any) -> None:
    registry = RegistryDouble(aws)
    with pytest.raises(ImageError, match=r"localhost/specdeploy-server:cuda is not built here"):
        image.push("localhost/specdeploy-server:cuda", _target(), aws, "t", run=registry, exists=lambda _: False)
    assert registry.calls == []


# ---- the command, end to end against moto -------------------------------------------------------------


@pytest.fixture
def stacks(tmp_path: Path) -> Path:
    directory = tmp_path / "stacks"
    shutil.copytree(project_stacks_dir(), directory)
    return directory


def test_push_pins_the_digest_as_the_slot_image_and_changes_nothing_else(
        aws: Any, stacks: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    aws.create_repository(repositoryName="specdeploy-prod")
    registry = RegistryDouble(aws)
    monkeypatch.setattr(image, "podman", registry)
    monkeypatch.setattr(image, "image_exists", lambda tag: tag == "localhost/specdeploy-server:cuda")
    before = yaml.safe_load((stacks / "Pulumi.prod.yaml").read_text())
    assert main(["image", "push", "--stack", "prod", "--pin-slot", "blue", "--stacks-dir", str(stacks)]) == 0
    pinned = capsys.readouterr().out.splitlines()[1]
    assert pinned.startswith(f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/specdeploy-prod@sha256:")
    assert registry.calls[1][-2] == "localhost/specdeploy-server:cuda"  # the GPU stack gets the cuda variant
    after = yaml.safe_load((stacks / "Pulumi.prod.yaml").read_text())
    assert after["config"]["specdeploy:release"]["blue"]["image"] == pinned
    after["config"]["specdeploy:release"]["blue"]["image"] = before["config"]["specdeploy:release"]["blue"]["image"]
    assert after == before
    assert load_stack("prod", stacks).config.slots.blue is not None


def test_push_refuses_the_cpu_variant_for_a_gpu_stack(
        aws: Any, stacks: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["image", "push", "--stack", "prod", "--variant", "cpu", "--stacks-dir", str(stacks)]) == 2
    assert "push the cuda variant" in capsys.readouterr().err


def test_push_refuses_a_stack_without_ecr(stacks: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["image", "push", "--stack", "local", "--stacks-dir", str(stacks)]) == 2
    assert "is platform local" in capsys.readouterr().err


def test_pinning_a_slot_the_stack_does_not_define_is_refused(stacks: Path) -> None:
    with pytest.raises(ImageError, match=r"release.green is not defined"):
        image.pin_slot(stacks / "Pulumi.prod.yaml", "green", f"{_target().uri}@sha256:" + "1" * 64)


def test_pin_slot_active_pins_the_stacks_active_slot(
        aws: Any, stacks: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    aws.create_repository(repositoryName="specdeploy-staging")
    monkeypatch.setattr(image, "podman", RegistryDouble(aws))
    monkeypatch.setattr(image, "image_exists", lambda tag: True)
    path = stacks / "Pulumi.staging.yaml"
    path.write_text(path.read_text().replace("active: blue", "active: green", 1).replace(
        "    blue:\n", "    green:\n", 1))
    assert main(["image", "push", "--stack", "staging", "--pin-slot", "active", "--stacks-dir", str(stacks)]) == 0
    pinned = capsys.readouterr().out.splitlines()[1]
    release = load_stack("staging", stacks).config.slots
    assert release.active == "green" and release.green is not None and release.green.image == pinned
