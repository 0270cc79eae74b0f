"""Kubernetes stacks built under Pulumi mocks, every registered resource recorded.

Fixtures: ``prod`` / ``dev`` build stacks k8s-prod / k8s-dev once per test module,
lazily, from inside the first ``@pulumi.runtime.test`` that asks (resources must be
registered while the Pulumi runtime runs); later tests read the resolved outputs of
the same components. ``render(stack, config)`` builds from outside the runtime and
``variant(stack, section={...})`` changes a stack's config for one test.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pytest

from infra.alerts import TRAFFIC_RECORD
from infra.config import PROJECT, StackConfig, load_stack
from infra.ops.k8s_render import render_objects
from infra.program.kubernetes import KubernetesStack, build_kubernetes
from serving import metric_names


@dataclass(frozen=True)
class Recorded:
    type_token: str
    name: str
    inputs: dict[str, Any]


class RecordingMocks(pulumi.runtime.Mocks):
    """Returns inputs as state (no autonaming) and keeps what each resource was given."""

    def __init__(self) -> None:
        self.records: list[Recorded] = []

    def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str, dict[str, Any]]:
        self.records.append(Recorded(args.typ, args.name, dict(args.inputs)))
        return f"{args.name}-id", args.inputs

    def call(self, args: pulumi.runtime.MockCallArgs) -> dict[str, Any]:
        return {}


@dataclass
class MockStack:
    stack: KubernetesStack
    records: list[Recorded]
    exports: dict[str, Any] = field(default_factory=dict)

    @property
    def manifests(self) -> list[dict[str, Any]]:
        return render_objects((r.type_token, r.inputs) for r in self.records)

    def objects(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.manifests if m["kind"] == kind]

    def one(self, kind: str, name: str) -> dict[str, Any]:
        found = [m for m in self.objects(kind) if m["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
        return found[0]


def build(stack_name: str, config: StackConfig | None = None) -> MockStack:
    """Register the whole stack under fresh mocks. Call inside a running @pulumi.runtime.test."""
    mocks = RecordingMocks()
    pulumi.runtime.set_mocks(mocks, project=PROJECT, stack=stack_name, preview=False)
    built = build_kubernetes(config or load_stack(stack_name).config)
    result = MockStack(built, mocks.records)
    return result


def build_recorded(stack_name: str, config: StackConfig | None = None) -> MockStack:
    """Build a stack from outside the Pulumi runtime (a fixture) and resolve its exports."""
    holder: dict[str, MockStack] = {}

    @pulumi.runtime.test
    def _run() -> pulumi.Output[None]:
        built = holder["stack"] = build(stack_name, config)
        return pulumi.Output.all(**built.stack.exports()).apply(built.exports.update)

    _run()
    return holder["stack"]


def variant(stack_name: str, **sections: dict[str, Any] | None) -> StackConfig:
    """A stack's config with sections merged (a dict) or removed (None), re-validated,
    e.g. ``variant("k8s-dev", kubernetes={"weight_cache": "hostPath"}, draft=None)``."""
    config = load_stack(stack_name).config
    data = config.model_dump()
    for section, changes in sections.items():
        data[section] = None if changes is None else {**(data.get(section) or {}), **changes}
    return StackConfig.model_validate(data)


class LazyStack:
    """One MockStack per test module, built by whichever test asks first."""

    def __init__(self, stack_name: str, config: StackConfig | None = None) -> None:
        self.stack_name = stack_name
        self.config = config
        self._built: MockStack | None = None

    def __call__(self) -> MockStack:
        if self._built is None:
            self._built = build(self.stack_name, self.config)
        return self._built


@pytest.fixture(scope="module")
def prod() -> LazyStack:
    return LazyStack("k8s-prod")


@pytest.fixture(scope="module")
def dev() -> LazyStack:
    return LazyStack("k8s-dev")


@pytest.fixture(scope="session")
def render() -> Callable[..., MockStack]:
    return build_recorded


@pytest.fixture(scope="session")
def variant_config() -> Callable[..., StackConfig]:
    return variant


def exported_series() -> set[str]:
    """Every series name the server can export: gauges as named, counters `_total`, histograms' parts."""
    names = {v for k, v in vars(metric_names).items() if k.isupper() and k != "PREFIX"}
    counters = {metric_names.REQUESTS, metric_names.PROMPT_TOKENS, metric_names.GENERATION_TOKENS,
                metric_names.PREEMPTIONS, metric_names.SPEC_DRAFTS, metric_names.SPEC_DRAFT_TOKENS,
                metric_names.SPEC_ACCEPTED_TOKENS, metric_names.SPEC_GUARD_CYCLES,
                metric_names.SPEC_GUARD_VETOED_CYCLES, metric_names.SPEC_GUARD_PLAIN_CYCLES,
                metric_names.SPEC_GUARD_VETOES}
    histograms = {n for n in names if n.endswith("_seconds")}
    gauges = names - counters - histograms
    return gauges | {f"{c}_total" for c in counters} | {f"{h}{s}" for h in histograms for s in
                                                         ("_bucket", "_sum", "_count")}


def series_in(expr: str) -> set[str]:
    """Metric names a PromQL expression selects: identifiers before `{` or `[`, and every specdeploy_* name."""
    without_strings = re.sub(r'"[^"]*"', '""', expr)
    without_matchers = re.sub(r"\{[^}]*\}", "{}", without_strings)
    selected = set(re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*[{\[]", without_matchers))
    selected |= set(re.findall(r"\b(specdeploy_[a-zA-Z0-9_]+)\b", without_matchers))
    without_groupings = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", without_matchers)
    # our own recording rule (the PrometheusRule specdeploy-traffic, tested apart) is not a server series
    return (selected & set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", without_groupings))) - {TRAFFIC_RECORD}


def queried_series(config: StackConfig) -> set[str]:
    """Every series the PrometheusRule and the dashboard of a stack read."""
    from infra.alerts import alert_rules
    from infra.components.kubernetes.dashboard import serving_dashboard

    dashboard = serving_dashboard()
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    queries += [rule.promql for rule in alert_rules(config)]
    return {name for query in queries for name in series_in(query)}


@pytest.fixture(scope="session")
def series_of() -> Callable[[str], set[str]]:
    return series_in


@pytest.fixture(scope="session")
def server_series() -> set[str]:
    return exported_series()


@pytest.fixture(scope="session")
def queried() -> Callable[[StackConfig], set[str]]:
    return queried_series
