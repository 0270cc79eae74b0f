"""Which availability zones of a region offer an EC2 instance type.

Not every zone offers every GPU type (p5 and g6e are in a few zones of a region at most), and an
autoscaling group whose subnets lie only in zones without the type never launches anything. The
answer comes from EC2's DescribeInstanceTypeOfferings with the operator's credentials and is kept
in a small JSON file per region beside the stack files (``specdeploy plan --refresh-offerings``), so that ``plan`` and
review can show it offline; nothing here is guessed or shipped as fact.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OFFERINGS_DIRNAME = "offerings"  # beside the stack files: commit it, so review and CI see the same zones


@dataclass(frozen=True)
class ZoneOfferings:
    region: str
    fetched_at: str  # UTC, ISO 8601
    zones_by_type: dict[str, list[str]]  # instance type -> zone names, sorted

    def zones(self, instance_type: str) -> list[str]:
        return self.zones_by_type.get(instance_type, [])


def offerings_path(stacks_dir: Path, region: str) -> Path:
    return stacks_dir / OFFERINGS_DIRNAME / f"{region}.json"


def fetch_offerings(region: str, instance_types: list[str], ec2: Any | None = None) -> ZoneOfferings:
    """Ask EC2 which zones of ``region`` offer each type (paginated; needs ec2:DescribeInstanceTypeOfferings)."""
    if ec2 is None:
        import boto3

        ec2 = boto3.client("ec2", region_name=region)
    zones: dict[str, set[str]] = {name: set() for name in instance_types}
    paginator = ec2.get_paginator("describe_instance_type_offerings")
    pages = paginator.paginate(LocationType="availability-zone",
                               Filters=[{"Name": "instance-type", "Values": sorted(instance_types)}])
    for page in pages:
        for offer in page.get("InstanceTypeOfferings", []):
            zones.setdefault(offer["InstanceType"], set()).add(offer["Location"])
    return ZoneOfferings(region, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         {name: sorted(found) for name, found in sorted(zones.items())})


def save_offerings(offerings: ZoneOfferings, path: Path) -> None:
    """Write-then-rename, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"region": offerings.region, "fetched_at": offerings.fetched_at, "zones": offerings.zones_by_type}
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    partial.replace(path)


def load_offerings(path: Path) -> ZoneOfferings | None:
    """The saved offerings, or None when they were never fetched; a damaged file is an error naming it."""
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
        return ZoneOfferings(str(body["region"]), str(body["fetched_at"]),
                             {str(k): [str(z) for z in v] for k, v in dict(body["zones"]).items()})
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not an offerings file ({exc}); refresh it with --refresh-offerings") from exc


def render_zones(offerings: ZoneOfferings | None, instance_type: str, region: str, refresh_hint: str) -> str:
    """The plan's `zones` line."""
    if offerings is None:
        return f"zones        unknown for {instance_type} in {region}: {refresh_hint}"
    found = offerings.zones(instance_type)
    if not found:
        return (f"zones        NONE of {region} offers {instance_type} (as of {offerings.fetched_at}): "
                f"pick another type or region")
    return f"zones        {', '.join(found)} offer {instance_type} (as of {offerings.fetched_at})"
