"""The rollout's launch-validation step: the quick profile against the new slot alone.

The orchestration calls a :data:`Validator`; the default one runs the launch
validation runner (``infra.validation``, the same checks as ``specdeploy validate``)
with the quick profile against one endpoint of the new slot. Tests inject their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from infra.config import StackFile
from infra.release.model import ReleaseError


@dataclass(frozen=True)
class ValidationOutcome:
    passed: bool
    summary: str  # one line: what failed, or how many checks passed
    report: str | None = None  # where the report was written


Validator = Callable[[StackFile, str, Path], ValidationOutcome]  # (stack, endpoint, report dir) -> outcome


def quick_validation(stack: StackFile, endpoint: str, report_dir: Path) -> ValidationOutcome:
    try:
        from infra.validation import run_validation
    except ImportError as exc:
        raise ReleaseError(
            f"the launch validation runner is not available ({exc}); "
            "pass --skip-validation only if the slot was validated by hand"
        ) from None
    result = run_validation(stack=stack.name, endpoint=endpoint, profile="quick", report_dir=report_dir)
    passed = bool(getattr(result, "passed", False))
    summary = str(getattr(result, "summary", "") or ("passed" if passed else "failed"))
    report = getattr(result, "report_path", None) or getattr(result, "html", None)
    return ValidationOutcome(passed, summary, None if report is None else str(report))
