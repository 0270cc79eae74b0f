"""`specdeploy preview --stack k8s-dev --render-k8s DIR` writes every Kubernetes object as YAML."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from infra.ops.cli.main import main


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    directory = tmp_path_factory.mktemp("render") / "k8s-dev"
    assert main(["preview", "--stack", "k8s-dev", "--render-k8s", str(directory)]) == 0
    return sorted(directory.iterdir())


def test_one_file_per_object_in_apply_order(written: list[Path]) -> None:
    kinds = [yaml.safe_load(p.read_text())["kind"] for p in written]
    assert kinds[0] == "Namespace"
    assert kinds.index("ConfigMap") < kinds.index("Deployment") < kinds.index("HorizontalPodAutoscaler")
    # one slot: no PVC (emptyDir cache), no canary Ingress; the release Role + binding, the traffic rule
    assert len(written) == 15


def test_written_built_in_objects_are_strictly_valid(written: list[Path]) -> None:
    for path in written:
        manifest = yaml.safe_load(path.read_text())
        if manifest["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # checked against tests/infra/components/kubernetes/schemas in test_k8s_manifests.py
        kubernetes_validate.validate(manifest, "1.33.0", strict=True)


def test_stack_without_kubernetes_objects_is_an_error(tmp_path: Path) -> None:
    from infra.config import load_stack
    from infra.ops.cli.main import CommandError
    from infra.ops.cli.preview_cmd import _render_k8s
    from infra.program.preview import PreviewResult, RecordedResource

    bucket = RecordedResource("aws:s3/bucket:Bucket", "models", "", {"bucket": "b"}, True)
    result = PreviewResult("dev", load_stack("dev").config, [bucket])
    with pytest.raises(CommandError, match="has no Kubernetes objects"):
        _render_k8s(result, tmp_path / "out")
    assert not (tmp_path / "out").exists()
