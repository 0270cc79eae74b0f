"""Pulumi's entry point (Pulumi.yaml `main: infra/`); the program itself is infra/program/."""

from infra.program import run

run()
