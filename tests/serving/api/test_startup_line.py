"""The server's own entry point takes the process-wide decision that has to precede torch (model.cpu_huge_pages)
and its start-up line states it, with the memory the process then holds in huge pages."""

from __future__ import annotations

import os
from typing import Any

from serving.engine.huge_pages import ENV, kernel_mode


def test_the_server_decides_huge_pages_before_torch_loads_and_says_so(server: Any) -> None:
    line = next(line for line in server.log_text().splitlines() if "start-up decisions: " in line)
    if ENV in os.environ:  # the operator's variable, passed on by the fixture, wins
        expected = f"({ENV}={os.environ[ENV]} in the environment; "
    elif kernel_mode() in ("always", "madvise"):
        expected = f"model.cpu_huge_pages on (auto: weights and KV cache in 2 MiB pages (THP mode {kernel_mode()}); "
    else:
        expected = "model.cpu_huge_pages off (auto: "
    assert expected in line, line
    assert "MiB in huge pages)" in line and "torch was loaded" not in line
