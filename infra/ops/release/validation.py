"""The rollout's launch-validation step: the quick profile against the new slot alone.

The orchestration calls a :data:`Validator`; :func:`launch_validator` builds the real
one on the launch validation runner (``infra.validation.run_validation``, the same
suite ``specdeploy validate`` runs), pointed at one endpoint of the new slot rather
than at the load balancer. Tests inject their own validator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from infra.config import StackFile

PROFILE = "quick"


@dataclass(frozen=True)
class ValidationOutcome:
    passed: bool
    summary: str  # one line: what failed, or that every check passed
    report: str | None = None  # the HTML report


Validator = Callable[[StackFile, str, Path], ValidationOutcome]  # (stack, endpoint, report dir) -> outcome


def launch_validator(hosts: Sequence[str] | None = None) -> Validator:
    """The quick launch validation; ``hosts`` are the slot's testinfra backends for the host checks."""

    def validate(stack: StackFile, endpoint: str, report_dir: Path) -> ValidationOutcome:
        from infra.validation import run_validation

        result = run_validation(endpoint, stack.name, profile=PROFILE, report_dir=report_dir,
                                hosts=list(hosts) if hosts else None)
        failed = result.failed_checks
        if result.passed:
            summary = f"{PROFILE} profile passed"
        elif failed:
            summary = f"{len(failed)} check(s) failed: {', '.join(failed[:5])}"
        else:
            summary = f"the suite could not run (pytest exit code {result.exit_code})"
        return ValidationOutcome(result.passed, summary, str(result.report_html))

    return validate
