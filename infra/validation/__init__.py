"""Launch validation: load generator, speculative A/B, report, and the runner behind
``specdeploy validate`` (the checks themselves are the pytest suite in ``infra/validation/launch``).

Nothing here imports torch or the server: it talks to any deployment over HTTP.
"""

from infra.validation.runner import ValidationResult, run_validation

__all__ = ["ValidationResult", "run_validation"]
