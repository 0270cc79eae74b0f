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
    assert "up-staging" in _upstream("up-prod") and prod["environment"] == "production"


def test_staging_is_validated_after_up() -> None:
    job = _job_running("specdeploy validate --stack staging")
    assert job == "up-staging" or "up-staging" in _upstream(job)


def _steps(job: str) -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = _jobs()[job]["steps"]
    return steps


def _index(job: str, needle: str) -> int:
    """Position of the first step of ``job`` whose run/uses/with mentions ``needle``."""
    for index, step in enumerate(_steps(job)):
        if needle in str(step.get("run", "")) + str(step.get("uses", "")) + str(step.get("with", "")):
            return index
    raise AssertionError(f"{job}: no step mentions {needle!r}")


def _needs(job: str) -> set[str]:
    needs = _jobs()[job].get("needs", [])
    return {needs} if isinstance(needs, str) else set(needs)


def _upstream(job: str) -> set[str]:
    """Every job ``job`` waits for, directly or through another."""
    seen: set[str] = set()
    todo = list(_needs(job))
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(_needs(name))
    return seen


def _job_running(command: str) -> str:
    jobs = [name for name in _jobs() if any(command in str(step.get("run", "")) for step in _steps(name))]
    assert jobs, f"no job runs {command!r}"
    return jobs[0]


def test_the_cuda_image_is_built_and_pushed_to_both_stacks_before_any_up() -> None:
    pushing = _job_running("specdeploy image push --stack staging")
    runs = _runs(pushing)
    assert "specdeploy image build --variant cuda" in runs
    assert "specdeploy image push --stack prod" in runs and "--pin-slot" in runs
    assert _index(pushing, "image build") < _index(pushing, "image push")
    for stack in ("staging", "prod"):
        up = next(name for name in _jobs() if f"specdeploy/{stack}" in _runs(name) and "'command': 'up'" in _runs(name))
        assert pushing in _upstream(up), f"`pulumi up` {stack} does not wait for the image push"
        # the up runs with the stack files that carry the pushed digests
        assert _index(up, "pinned-stacks") < _index(up, "'command': 'up'")


def test_staging_is_validated_from_where_its_internal_endpoint_is_reachable() -> None:
    job = _job_running("specdeploy validate --stack staging")
    runs_on = _jobs()[job]["runs-on"]
    inside_vpc = isinstance(runs_on, list) and "self-hosted" in runs_on
    step = _steps(job)[_index(job, "specdeploy validate --stack staging")]
    tunnel = "AWS-StartPortForwardingSessionToRemoteHost" in step["run"] and "127.0.0.1" in step["run"]
    assert inside_vpc or tunnel, "a hosted runner cannot reach staging's internal load balancer"


def test_validation_gets_the_api_key_from_a_secret() -> None:
    for stack in ("staging", "prod"):
        job = _job_running(f"specdeploy validate --stack {stack}")
        step = _steps(job)[_index(job, f"specdeploy validate --stack {stack}")]
        key = step.get("env", {}).get("SPECDEPLOY_API_KEY", "")  # what `specdeploy validate` reads
        assert key.startswith("${{ secrets."), f"{stack}: validation without the API key from a secret"


def test_prod_waits_for_staging_validation_and_an_approval() -> None:
    prod = next(name for name in _jobs() if "specdeploy/prod" in _runs(name) and "'command': 'up'" in _runs(name))
    assert _job_running("specdeploy validate --stack staging") in _upstream(prod)
    assert _jobs()[prod]["environment"] == "production"


def test_nothing_is_pushed_or_deployed_from_a_pull_request() -> None:
    for name in _jobs():
        if "image push" in _runs(name) or "'command': 'up'" in _runs(name):
            condition = str(_jobs()[name].get("if", ""))
            upstream_conditions = " ".join(str(_jobs()[u].get("if", "")) for u in _upstream(name))
            assert "github.event_name != 'pull_request'" in condition + upstream_conditions, name


def test_every_pulumi_up_refreshes_first() -> None:
    # Listener and route weights, canary annotations and alarm actions are ignore_changes (the release commands
    # own them); an update sends the state's values for those, so the state must be the live one
    # (tests/infra/ops/release/test_release_converges_kubernetes.py shows what a stale state would send).
    ups = [step for job in ("up-staging", "up-prod") for step in _steps(job)
           if step.get("uses", "").startswith("pulumi/actions") and step.get("with", {}).get("command") == "up"]
    assert len(ups) == 2
    assert all(step["with"].get("refresh") is True for step in ups)
