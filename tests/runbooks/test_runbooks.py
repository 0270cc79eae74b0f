"""runbooks/: one file per alarm of either platform, linked from the alarm; the procedures; every
row of the guides' troubleshooting tables; and every `specdeploy …` command in them parses."""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from infra.alerts import alert_rules
from infra.config import REPO_ROOT, available_stacks, load_stack
from infra.ops.cli.main import build_parser

RUNBOOKS = REPO_ROOT / "runbooks"
PROCEDURES = ("rollout.md", "rollback.md", "scale-out.md", "cold-start.md", "rotate-api-keys.md",
              "speculative-decoding-decision.md")
# The troubleshooting tables of the two deployment guides (planning/launch/operations section 九,
# deployment and speculative decoding section 八): each symptom as README.md names it.
TROUBLESHOOTING_ROWS = ("启动即OOM", "运行中OOM", "推测解码无收益甚至更慢", "首批请求极慢", "服务不可达",
                        "首token延迟高", "生成速度慢", "吞吐上不去", "请求大量超时")
SECTIONS = ("## Meaning", "## Impact", "## Diagnosis", "## Mitigation")
STACKS = available_stacks()


def runbook_files() -> list[Path]:
    return sorted(RUNBOOKS.glob("*.md"))


@pytest.mark.parametrize("stack", STACKS)
def test_every_alarm_of_the_stack_has_its_runbook_and_link(stack: str) -> None:
    config = load_stack(stack).config
    base = config.alerting.runbook_base_url
    assert base.rstrip("/").endswith("/runbooks"), f"{stack}: alerting.runbook_base_url must point at runbooks/"
    for rule in alert_rules(config):
        path = RUNBOOKS / f"{rule.name}.md"
        assert path.is_file(), f"{stack}: alarm {rule.name} has no {path.relative_to(REPO_ROOT)}"
        assert rule.runbook_url(base) == f"{base.rstrip('/')}/{rule.name}.md"
        assert rule.runbook_url(base) in rule.description(base)


def _linked_runbook(url: str) -> Path:
    assert "/runbooks/" in url, url
    return RUNBOOKS / url.rsplit("/runbooks/", 1)[1]


@pytest.fixture(scope="module")
def rendered_alarms() -> dict[str, list[tuple[str, str]]]:
    """(alarm name, runbook link) of every alarm as each platform renders it: CloudWatch alarms of
    stack prod (aws) and PrometheusRule rules of stack k8s-prod (kubernetes), offline."""
    from infra.ops.k8s_render import render_objects
    from infra.program.preview import record_stack

    aws = record_stack("prod")
    cloudwatch = []
    for resource in aws.of_type("aws:cloudwatch/metricAlarm:MetricAlarm"):
        links = re.findall(r"https?://\S+\.md", resource.inputs["alarmDescription"])
        cloudwatch.append((resource.inputs["name"], links[0] if links else ""))
    k8s = record_stack("k8s-prod")
    prometheus = []
    for obj in render_objects((r.type, r.inputs) for r in k8s.resources):
        if obj["kind"] == "PrometheusRule":
            for group in obj["spec"]["groups"]:
                for rule in (r for r in group["rules"] if "alert" in r):  # specdeploy-traffic only records
                    prometheus.append((rule["alert"], rule.get("annotations", {}).get("runbook_url", "")))
    return {"aws": cloudwatch, "kubernetes": prometheus}


@pytest.mark.parametrize(("platform", "stack"), [("aws", "prod"), ("kubernetes", "k8s-prod")])
def test_rendered_alarms_link_an_existing_runbook(rendered_alarms: dict[str, list[tuple[str, str]]],
                                                  platform: str, stack: str) -> None:
    alarms = rendered_alarms[platform]
    expected = {rule.name for rule in alert_rules(load_stack(stack).config)}
    # CloudWatch: <stack>-<slot>-<Rule>, one per slot; Prometheus: the rule name (slot in a label)
    assert {name.removeprefix(f"{stack}-").removeprefix("blue-").removeprefix("green-")
            for name, _ in alarms} == expected
    for name, link in alarms:
        runbook = _linked_runbook(link)
        assert runbook.is_file(), f"{platform} alarm {name} links {link}: no such runbook"
        assert name.endswith(runbook.stem), f"{platform} alarm {name} links another alarm's runbook {link}"


@pytest.mark.parametrize("rule", alert_rules(load_stack("prod").config), ids=lambda r: r.name)
def test_alarm_runbook_has_the_sections_owner_and_severity(rule: Any) -> None:
    text = (RUNBOOKS / f"{rule.name}.md").read_text(encoding="utf-8")
    assert text.startswith(f"# {rule.name}\n")
    positions = [text.find(section) for section in SECTIONS]
    assert -1 not in positions and positions == sorted(positions), f"{rule.name}: sections {SECTIONS} in order"
    assert re.search(rf"\| Severity \| \*\*{rule.severity}\*\*", text), f"{rule.name}: severity {rule.severity}"
    assert "| Owner |" in text
    diagnosis = text[text.find("## Diagnosis"):text.find("## Mitigation")]
    assert "```sh" in diagnosis, f"{rule.name}: diagnosis needs commands to paste"


@pytest.mark.parametrize("name", PROCEDURES)
def test_procedure_exists_with_an_owner(name: str) -> None:
    text = (RUNBOOKS / name).read_text(encoding="utf-8")
    assert text.startswith("# ") and "| Owner |" in text


def test_readme_indexes_every_runbook() -> None:
    readme = (RUNBOOKS / "README.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(([\w.-]+\.md)\)", readme))
    assert {p.name for p in runbook_files()} - {"README.md"} <= linked


@pytest.mark.parametrize("symptom", TROUBLESHOOTING_ROWS)
def test_every_troubleshooting_row_maps_to_a_runbook(symptom: str) -> None:
    readme = (RUNBOOKS / "README.md").read_text(encoding="utf-8")
    rows = [line for line in readme.splitlines() if line.startswith("|") and symptom in line]
    assert len(rows) == 1, f"{symptom}: one row in runbooks/README.md"
    targets = re.findall(r"\]\(([\w.-]+\.md)\)", rows[0].split("|")[-2])
    assert targets, f"{symptom}: no runbook linked"
    for target in targets:
        text = (RUNBOOKS / target).read_text(encoding="utf-8")
        assert "## Diagnosis" in text and "## Mitigation" in text or target in PROCEDURES, target


@pytest.mark.parametrize("path", runbook_files(), ids=lambda p: p.name)
def test_relative_links_resolve(path: Path) -> None:
    for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", path.read_text(encoding="utf-8")):
        assert (path.parent / target).is_file(), f"{path.name} links missing {target}"


# --- every `specdeploy …` command written in a runbook parses ---------------------------------------


def block_commands(text: str) -> list[str]:
    """`specdeploy …` commands in shell blocks, one per line or after `&&`/`;`/`|`."""
    commands: list[str] = []
    for block in re.findall(r"```(?:sh|bash|console)?\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            for part in re.split(r"&&|;|\|", line):
                part = part.strip().removeprefix("$ ")
                if part.startswith("specdeploy "):
                    commands.append(part)
    return commands


def specdeploy_commands(text: str) -> list[str]:
    """`specdeploy …` commands in shell blocks and in inline code."""
    commands = block_commands(text)
    for span in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
        if span.startswith("specdeploy ") and "…" not in span and "<" not in span:
            commands.append(span)
    return commands


ALL_COMMANDS = sorted({(p.name, c) for p in runbook_files() for c in specdeploy_commands(p.read_text("utf-8"))})


def test_runbooks_use_specdeploy_commands() -> None:
    used = {shlex.split(c)[1] for _, c in ALL_COMMANDS}
    assert {"rollout", "rollback", "plan", "config"} <= used


def runbook_mentions_only(command: str, runbook: str) -> bool:
    return command not in block_commands((RUNBOOKS / runbook).read_text(encoding="utf-8"))


def _subcommand_path(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    path: list[str] = []
    current = parser
    for token in argv:
        subparsers = [a for a in current._actions if isinstance(a, argparse._SubParsersAction)]
        if not subparsers or token not in subparsers[0].choices:
            break
        path.append(token)
        current = subparsers[0].choices[token]
    return path


@functools.cache
def parser() -> argparse.ArgumentParser:
    return build_parser()


def parse_problem(command: str, mention_only: bool = False) -> str | None:
    """Why ``command`` does not parse with the real parser (None when it does).

    ``mention_only``: prose naming a subcommand (`specdeploy weights pull`) needs only its --help.
    """
    argv = shlex.split(command, comments=True)[1:]
    path = _subcommand_path(parser(), argv)
    if not path:
        return "no such subcommand"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser().parse_args([*path, "--help"])
        except SystemExit as exc:
            if exc.code != 0:
                return f"`specdeploy {' '.join(path)} --help` failed"
        if argv == path and mention_only:
            return None
        try:
            args = parser().parse_args(argv)
        except SystemExit:
            return err.getvalue().strip().splitlines()[-1]
    return None if hasattr(args, "func") else "names no runnable command"


@pytest.mark.parametrize(("runbook", "command"), ALL_COMMANDS, ids=[f"{r}:{c}" for r, c in ALL_COMMANDS])
def test_runbook_command_parses(runbook: str, command: str) -> None:
    problem = parse_problem(command, mention_only=runbook_mentions_only(command, runbook))
    assert problem is None, f"{runbook}: `{command}`: {problem}"


@pytest.mark.parametrize("command", ["specdeploy rollout --stack prod --too green", "specdeploy rolout --stack prod",
                                     "specdeploy rollout --stack prod", "specdeploy weights push"])
def test_the_check_rejects_a_broken_command(command: str) -> None:
    assert parse_problem(command) is not None
