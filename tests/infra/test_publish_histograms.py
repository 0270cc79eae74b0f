"""The histogram publisher turns Prometheus buckets into CloudWatch value/count sets."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from infra.components.aws.user_data import TEMPLATES

SCRAPE = """
# TYPE specdeploy_time_to_first_token_seconds histogram
specdeploy_time_to_first_token_seconds_bucket{le="0.1"} 3
specdeploy_time_to_first_token_seconds_bucket{le="0.5"} 7
specdeploy_time_to_first_token_seconds_bucket{le="+Inf"} 8
specdeploy_e2e_request_latency_seconds_bucket{endpoint="chat",le="1.0"} 2
specdeploy_e2e_request_latency_seconds_bucket{endpoint="completions",le="1.0"} 1
specdeploy_e2e_request_latency_seconds_bucket{endpoint="chat",le="+Inf"} 2
specdeploy_e2e_request_latency_seconds_bucket{endpoint="completions",le="+Inf"} 1
specdeploy_requests_waiting 4
"""


def _publisher() -> ModuleType:
    spec = importlib.util.spec_from_file_location("publish_histograms", TEMPLATES / "publish_histograms.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_buckets_are_summed_over_label_sets() -> None:
    parsed = _publisher().parse_buckets(SCRAPE)
    assert parsed["specdeploy_e2e_request_latency_seconds"] == {"1.0": 3.0, "+Inf": 3.0}


def test_increments_are_per_bucket_not_cumulative() -> None:
    publisher = _publisher()
    ttft = publisher.parse_buckets(SCRAPE)["specdeploy_time_to_first_token_seconds"]
    assert publisher.increments({}, ttft) == [(0.1, 3.0), (0.5, 4.0), (0.5, 1.0)]  # +Inf reported at the last bound


def test_only_new_observations_are_published() -> None:
    publisher = _publisher()
    before = {"0.1": 3.0, "0.5": 7.0, "+Inf": 8.0}
    after = {"0.1": 3.0, "0.5": 9.0, "+Inf": 10.0}
    assert publisher.increments(before, after) == [(0.5, 2.0)]


def test_a_counter_reset_starts_over() -> None:
    publisher = _publisher()
    assert publisher.increments({"0.1": 5.0, "+Inf": 5.0}, {"0.1": 1.0, "+Inf": 1.0}) == [(0.1, 1.0)]


def test_datum_carries_values_counts_and_the_group() -> None:
    datum = _publisher().metric_data("asg-1", "m", [(0.1, 3.0), (0.5, 4.0)])
    assert (datum["Values"], datum["Counts"], datum["Dimensions"]) == (
        [0.1, 0.5], [3.0, 4.0], [{"Name": "AutoScalingGroupName", "Value": "asg-1"}])
