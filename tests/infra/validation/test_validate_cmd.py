from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from infra.ops.cli.main import main, registered_commands


def test_validate_and_loadgen_are_subcommands() -> None:
    assert {"validate", "loadgen"} <= registered_commands()


def test_loadgen_prints_one_summary_per_concurrency_level(serve_fake: Any, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "phases.json"
    with serve_fake() as (endpoint, _):
        code = main(["loadgen", "--endpoint", endpoint, "--concurrency", "1,2", "--requests", "3",
                     "--prompt-set", "code", "--max-tokens", "4", "--stack", "local", "--json", str(out)])
    assert code == 0
    summaries = json.loads(capsys.readouterr().out)
    assert [s["concurrency"] for s in summaries] == [1, 2]
    assert all(s["completed"] == 3 and s["goodput_share"] == 1.0 for s in summaries)
    assert len(json.loads(out.read_text())[0]["records"]) == 3


def test_loadgen_open_loop_needs_a_duration(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["loadgen", "--endpoint", "http://127.0.0.1:9", "--rate", "2"]) == 2
    assert "--duration" in capsys.readouterr().err


def test_validate_refuses_an_unknown_stack(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--stack", "nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_validate_says_when_nothing_answers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--stack", "local", "--endpoint", "http://127.0.0.1:9"]) == 2
    assert "nothing answers at http://127.0.0.1:9" in capsys.readouterr().err
