"""Re-export of the packaged launch suite (infra/validation/launch/) so `pytest tests/launch` runs it."""

from infra.validation.launch.test_performance import *  # noqa: F403
