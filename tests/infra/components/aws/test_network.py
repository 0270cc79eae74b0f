"""Network: private subnets for instances, public subnets only for a public service, no NAT."""

from __future__ import annotations

from collections.abc import Callable

import pulumi
import pytest

from infra.components.aws.network import INTERFACE_ENDPOINTS, Network, NetworkArgs
from infra.config import PROJECT
from infra.program.preview import PreviewResult, new_mocks

StackFn = Callable[[str], PreviewResult]
VariantFn = Callable[..., PreviewResult]


def _subnets(result: PreviewResult, tier: str) -> list[dict[str, object]]:
    return [r.inputs for r in result.of_type("aws:ec2/subnet:Subnet") if r.inputs["tags"]["tier"] == tier]


@pytest.mark.parametrize("stack", ["dev", "staging", "prod"])
@pulumi.runtime.test
def test_two_private_subnets_in_different_zones(stack: str, aws_stack: StackFn) -> None:
    zones = {s["availabilityZone"] for s in _subnets(aws_stack(stack), "private")}
    assert len(zones) == 2


@pytest.mark.parametrize("stack", ["dev", "staging", "prod"])
@pulumi.runtime.test
def test_no_subnet_hands_out_public_addresses(stack: str, aws_stack: StackFn) -> None:
    assert all(r.inputs["mapPublicIpOnLaunch"] is False for r in aws_stack(stack).of_type("aws:ec2/subnet:Subnet"))


@pytest.mark.parametrize("stack", ["dev", "staging"])
@pulumi.runtime.test
def test_internal_stacks_have_no_public_subnets_or_gateway(stack: str, aws_stack: StackFn) -> None:
    result = aws_stack(stack)
    assert not _subnets(result, "public") and not result.of_type("aws:ec2/internetGateway:InternetGateway")


@pulumi.runtime.test
def test_public_stack_has_public_subnets_routed_to_the_internet(aws_stack: StackFn) -> None:
    route = aws_stack("prod").one("aws:ec2/routeTable:RouteTable", "net-public-rt").inputs["routes"][0]
    assert len(_subnets(aws_stack("prod"), "public")) == 2 and route["cidrBlock"] == "0.0.0.0/0"


@pytest.mark.parametrize("stack", ["dev", "prod"])
@pulumi.runtime.test
def test_private_route_table_has_no_route_out(stack: str, aws_stack: StackFn) -> None:
    assert not aws_stack(stack).one("aws:ec2/routeTable:RouteTable", "net-private-rt").inputs.get("routes")


@pytest.mark.parametrize("stack", ["dev", "prod"])
@pulumi.runtime.test
def test_aws_services_are_reached_through_endpoints(stack: str, aws_stack: StackFn) -> None:
    services = {r.inputs["serviceName"].split("us-east-1.", 1)[1] for r in
                aws_stack(stack).of_type("aws:ec2/vpcEndpoint:VpcEndpoint")}
    assert services == {"s3", *INTERFACE_ENDPOINTS}


@pulumi.runtime.test
def test_existing_vpc_is_used_as_given(aws_variant: VariantFn) -> None:
    result = aws_variant("dev", access={"vpc_id": "vpc-0abc", "private_subnet_ids": ["subnet-1", "subnet-2"]})
    assert not result.of_type("aws:ec2/vpc:Vpc")
    assert result.single("aws:lb/loadBalancer:LoadBalancer").inputs["subnets"] == ["subnet-1", "subnet-2"]



def test_tiny_cidr_is_refused() -> None:
    with pytest.raises(ValueError, match="cidr_block 10.0.0.0/24 is too small"):
        NetworkArgs(region="us-east-1", public=False, cidr_block="10.0.0.0/24")


_built: dict[str, Network] = {}


def _network() -> Network:
    if "net" not in _built:
        pulumi.runtime.set_mocks(new_mocks(), project=PROJECT, stack="unit", preview=False)
        _built["net"] = Network("net", NetworkArgs(region="us-east-1", public=True))
    return _built["net"]


@pulumi.runtime.test
def test_output_lists_both_private_subnets() -> pulumi.Output[None]:
    def check(ids: list[str]) -> None:
        assert ids == ["net-private-0-id", "net-private-1-id"]

    return _network().private_subnet_ids.apply(check)


@pulumi.runtime.test
def test_output_vpc_is_the_created_one() -> pulumi.Output[None]:
    def check(vpc: str) -> None:
        assert vpc == "net-vpc-id"

    return _network().vpc_id.apply(check)
