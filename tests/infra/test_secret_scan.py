"""No secret value appears unmarked: every recorded input, output, export and rendered file is scanned.

The stack files' `secure:` values become recognisable placeholders (infra/program/preview.py); the
only place a placeholder may reach is a property that arrived marked secret (then it is
masked in the record). The positive control proves the scan is not vacuous.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pulumi
import pytest

from infra.components.aws.user_data import decode_user_data
from infra.config import SECRET_MASK, load_stack
from infra.program.preview import PreviewResult, secret_placeholders

StackFn = Callable[[str], PreviewResult]
STACKS = ("dev", "staging", "prod")


def _everything_recorded(result: PreviewResult) -> list[tuple[str, str]]:
    """(where, text) for every recorded input and output, exports, and decoded user-data."""
    texts = [(f"{r.type} {r.name} inputs", json.dumps(r.inputs)) for r in result.resources]
    texts += [(f"{r.type} {r.name} outputs", json.dumps(r.outputs)) for r in result.resources]
    texts.append(("exports", json.dumps(result.exports, default=str)))
    texts += [(f"{r.name} user-data", decode_user_data(r.inputs["userData"]))
              for r in result.of_type("aws:ec2/launchTemplate:LaunchTemplate")]
    texts.append(("capacity plan", result.plan_text or ""))
    return texts


@pytest.mark.parametrize("stack", STACKS)
def test_stack_has_secrets_to_look_for(stack: str) -> None:
    assert secret_placeholders(load_stack(stack))


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_no_secret_value_is_recorded_unmarked(stack: str, aws_stack: StackFn) -> None:
    placeholders = secret_placeholders(load_stack(stack))
    leaks = [where for where, text in _everything_recorded(aws_stack(stack)) for p in placeholders if p in text]
    assert leaks == []


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_the_secret_did_reach_its_one_place_marked(stack: str, aws_stack: StackFn) -> None:
    marked = [(r.name, r.secret_paths) for r in aws_stack(stack).resources if r.secret_paths]
    assert marked == [("api-keys-version", ("secretString",))]
    assert aws_stack(stack).one("aws:secretsmanager/secretVersion:SecretVersion", "api-keys-version").inputs[
        "secretString"] == SECRET_MASK


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_preview_output_shows_no_secret(stack: str, aws_stack: StackFn) -> None:
    from infra.program.preview import render

    text = render(aws_stack(stack))
    assert not [p for p in secret_placeholders(load_stack(stack)) if p in text]
