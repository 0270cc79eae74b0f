"""Publish the server's latency histograms to CloudWatch so alarms can take a fleet-wide p99.

The CloudWatch agent drops Prometheus histograms. This script runs every minute on each
instance (systemd timer, stdlib only), takes the per-bucket increments since its previous
run and sends them with PutMetricData Values/Counts (the bucket's upper bound as the
value). CloudWatch computes percentiles over such data across all instances of the group,
the same quantity as histogram_quantile over the fleet in Prometheus (bucket resolution).
Installed by the user-data at /opt/specdeploy/publish_histograms.py.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

HISTOGRAMS = ("specdeploy_time_to_first_token_seconds", "specdeploy_e2e_request_latency_seconds")
STATE_FILE = Path("/var/lib/specdeploy/histograms.json")
_BUCKET = re.compile(r'^(?P<name>[a-zA-Z_:][\w:]*)_bucket\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)')
_LE = re.compile(r'le="(?P<le>[^"]+)"')
MAX_VALUES = 150  # PutMetricData limit per datum


def parse_buckets(text: str, names: tuple[str, ...] = HISTOGRAMS) -> dict[str, dict[str, float]]:
    """Cumulative bucket counts per histogram, summed over label sets: name -> {le: count}."""
    out: dict[str, dict[str, float]] = {name: {} for name in names}
    for line in text.splitlines():
        match = _BUCKET.match(line)
        if not match or match["name"] not in out:
            continue
        le = _LE.search(match["labels"])
        if le:
            buckets = out[match["name"]]
            buckets[le["le"]] = buckets.get(le["le"], 0.0) + float(match["value"])
    return out


def increments(previous: dict[str, float], current: dict[str, float]) -> list[tuple[float, float]]:
    """(upper bound, observations) per bucket since the previous scrape; a counter reset starts over."""
    if any(current.get(le, 0.0) < count for le, count in previous.items()):
        previous = {}
    bounds = sorted(current, key=lambda le: math.inf if le == "+Inf" else float(le))
    finite = [float(le) for le in bounds if le != "+Inf"]
    pairs: list[tuple[float, float]] = []
    below = 0.0
    for le in bounds:
        cumulative = current[le] - previous.get(le, 0.0)
        count = cumulative - below
        below = cumulative
        if count > 0:
            # Observations above the last finite bound are reported at that bound (a floor).
            pairs.append((float(le) if le != "+Inf" else (finite[-1] if finite else 0.0), count))
    return pairs[:MAX_VALUES]


def metric_data(asg: str, name: str, pairs: list[tuple[float, float]]) -> dict[str, object]:
    return {
        "MetricName": name,
        "Dimensions": [{"Name": "AutoScalingGroupName", "Value": asg}],
        "Values": [value for value, _ in pairs],
        "Counts": [count for _, count in pairs],
        "Unit": "Seconds",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--asg", required=True)
    parser.add_argument("--region", required=True)
    parser.add_argument("--key-file", type=Path)
    parser.add_argument("--state-file", type=Path, default=STATE_FILE)
    args = parser.parse_args(argv)
    request = urllib.request.Request(args.url)
    if args.key_file:
        request.add_header("Authorization", f"Bearer {args.key_file.read_text().strip()}")
    with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 - loopback only
        current = parse_buckets(response.read().decode())
    previous = json.loads(args.state_file.read_text()) if args.state_file.exists() else {}
    args.state_file.write_text(json.dumps(current))
    # The first run only records a baseline: counts since the server started are not one minute's worth.
    data = [metric_data(args.asg, name, pairs) for name in HISTOGRAMS
            if name in previous and (pairs := increments(previous[name], current[name]))]
    if not data:
        return 0
    payload = json.dumps({"Namespace": args.namespace, "MetricData": data})
    result = subprocess.run(
        ["aws", "cloudwatch", "put-metric-data", "--region", args.region, "--cli-input-json", payload],
        check=False, capture_output=True, text=True,
    )
    if result.returncode:
        sys.stderr.write(result.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
