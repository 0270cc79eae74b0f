"""The example review/release workflow wires the same checks this repository runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

WORKFLOW = Path(__file__).resolve().parents[2] / ".github" / "workflows" / "deploy.yml"


def _jobs() -> dict[str, Any]:
    jobs: dict[str, Any] = yaml.safe_load(WORKFLOW.read_text())["jobs"]
    return jobs


def _runs(job: str) -> str:
    return "\n".join(str(step.get("run", "")) + str(step.get("with", "")) for step in _jobs()[job]["steps"])


def test_pull_requests_run_plan_offline_preview_and_pulumi_preview_with_the_pack() -> None:
    review = _runs("review")
    assert "specdeploy plan --stack" in review and "specdeploy preview --stack" in review
    assert "'command': 'preview'" in review and "'policyPacks': 'infra/policy'" in review


def test_prod_follows_staging_behind_an_approval() -> None:
    prod = _jobs()["up-prod"]
    assert prod["needs"] == ["up-staging"] and prod["environment"] == "production"


def test_staging_is_validated_after_up() -> None:
    assert "specdeploy validate --stack staging" in _runs("up-staging")
