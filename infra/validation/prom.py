"""Just enough of the Prometheus text format to read a server's /metrics page."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\d+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    name: str  # full series name as exported, e.g. specdeploy_requests_total
    labels: dict[str, str] = field(default_factory=dict)
    value: float = 0.0


def parse(text: str) -> list[Sample]:
    """Every sample on the page; comment and malformed lines are skipped."""
    samples: list[Sample] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, _, labels, raw, _ = match.groups()
        try:
            value = float(raw)
        except ValueError:
            continue
        samples.append(Sample(name, dict(_LABEL.findall(labels or "")), value))
    return samples


def series_names(text: str) -> set[str]:
    """Names of every series present (with `_total`, `_bucket`, ... suffixes as exported)."""
    return {s.name for s in parse(text)}


def value(samples: list[Sample], name: str, **labels: str) -> float | None:
    """Sum of the samples of ``name`` whose labels include ``labels``; None if there are none."""
    found = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    if not found:
        return None
    total = sum(found)
    return None if math.isnan(total) else total
