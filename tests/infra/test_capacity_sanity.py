"""Capacity sanity before `pulumi up`: spot pools that keep the GPU count, the vCPU quotas a fleet draws on,
and the zones of the region that offer the planned type (EC2's answer, through loopback moto)."""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

import pytest

from infra.capacity import VCPU_QUOTA_CODES, plan
from infra.catalog import CATALOG, instance_names, instance_type
from infra.config import available_stacks, load_stack
from infra.offerings import fetch_offerings, load_offerings, offerings_path, render_zones, save_offerings
from infra.ops.cli.main import main

AWS_STACKS = [name for name in available_stacks() if load_stack(name).config.platform == "aws"]


def test_the_prod_spot_pools_leave_out_the_eight_gpu_size() -> None:
    # prod plans p5.4xlarge (one H100): p5.48xlarge has the same GPU but eight of them, seven idle.
    result = plan(load_stack("prod").config)
    assert result.instance.name == "p5.4xlarge"
    assert "p5.48xlarge" not in result.same_gpu_alternatives(5)


@pytest.mark.parametrize("stack", AWS_STACKS)
def test_every_spot_alternative_has_the_planned_gpu_and_gpu_count(stack: str) -> None:
    result = plan(load_stack(stack).config)
    for name in result.same_gpu_alternatives(10):
        alternative = instance_type(name)
        assert alternative is not None
        assert (alternative.gpu, alternative.gpus) == (result.instance.gpu, result.instance.gpus), name


@pytest.mark.parametrize("stack", AWS_STACKS)
def test_the_quota_need_counts_both_slots_at_max_size(stack: str) -> None:
    config = load_stack(stack).config
    result = plan(config)
    needs = result.vcpu_quota_need(config.fleet.capacity_type)
    assert needs, "a GPU fleet always draws on a P or G quota"
    for need in needs:
        assert need.vcpus == 2 * config.fleet.max_size * result.instance.vcpus
        assert need.quota_code == VCPU_QUOTA_CODES[(need.family, need.market)]
        assert need.family == ("P" if result.instance.name.startswith("p") else "G")


def test_a_mixed_fleet_needs_both_the_on_demand_and_the_spot_quota() -> None:
    config = load_stack("staging").config
    config = config.model_copy(update={"fleet": config.fleet.model_copy(update={"capacity_type": "mixed"})})
    assert {n.market for n in plan(config).vcpu_quota_need("mixed")} == {"on-demand", "spot"}


@pytest.fixture
def ec2(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    import boto3

    urllib.request.urlopen(urllib.request.Request(f"{moto_endpoint}/moto-api/reset", method="POST")).close()
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": moto_endpoint}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return boto3.client("ec2", region_name="us-east-1")


def test_offerings_come_from_ec2_per_zone_and_round_trip(ec2, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    offerings = fetch_offerings("us-east-1", instance_names(), ec2)
    answer = ec2.describe_instance_type_offerings(
        LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": ["g5.xlarge"]}])
    expected = sorted(o["Location"] for o in answer["InstanceTypeOfferings"])
    assert offerings.zones("g5.xlarge") == expected
    assert set(offerings.zones_by_type) == {item.name for item in CATALOG}
    path = offerings_path(tmp_path, "us-east-1")
    save_offerings(offerings, path)
    assert load_offerings(path) == offerings


def test_a_type_no_zone_offers_is_said_plainly() -> None:
    from infra.offerings import ZoneOfferings

    none = ZoneOfferings("eu-north-1", "2026-12-03T00:00:00Z", {"p5.4xlarge": []})
    assert "NONE of eu-north-1 offers p5.4xlarge" in render_zones(none, "p5.4xlarge", "eu-north-1", "refresh")
    assert "unknown" in render_zones(None, "p5.4xlarge", "eu-north-1", "refresh")


def test_a_damaged_offerings_file_is_an_error_naming_it(tmp_path: Path) -> None:
    path = offerings_path(tmp_path, "us-east-1")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"us-east-1\.json: not an offerings file"):
        load_offerings(path)


def test_plan_refreshes_and_prints_the_zones_of_the_planned_type(
        ec2, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    stacks = tmp_path / "stacks"
    stacks.mkdir()
    shutil.copy(load_stack("prod").path, stacks / "Pulumi.prod.yaml")
    assert main(["plan", "--stack", "prod", "--stacks-dir", str(stacks)]) == 0
    assert "zones        unknown for p5.4xlarge" in capsys.readouterr().out
    assert main(["plan", "--stack", "prod", "--stacks-dir", str(stacks), "--refresh-offerings", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    offered = ec2.describe_instance_type_offerings(
        LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": ["p5.4xlarge"]}])
    assert printed["zones"] == sorted(o["Location"] for o in offered["InstanceTypeOfferings"])
    assert (stacks / "offerings" / "us-east-1.json").is_file()
