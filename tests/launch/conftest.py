"""The launch suite's options, fixtures and report hooks live in infra/validation/launch/conftest.py
(packaged with ``specdeploy validate``); re-exported so ``pytest tests/launch`` runs the same suite."""

from infra.validation.launch.conftest import *  # noqa: F403
from infra.validation.launch.conftest import _host_checks_need_a_serving_host  # noqa: F401 - autouse fixture
