"""Network: the VPC the fleet and the load balancer live in.

Either an existing VPC (ids from `access.*`) or a new one with private subnets
for the instances in two availability zones, and public subnets only when the
service is public. Private subnets have no route to the internet: the instances
reach S3 through a gateway endpoint and ECR, Secrets Manager, CloudWatch and SSM
through interface endpoints, so no NAT gateway (and no egress path) is needed.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

from infra.components.aws.common import child, tags

# AWS services an instance talks to during boot and while serving.
# autoscaling: user-data completes the launch lifecycle hook once the server is ready.
INTERFACE_ENDPOINTS = ("ecr.api", "ecr.dkr", "secretsmanager", "monitoring", "logs", "ssm", "ssmmessages",
                       "ec2messages", "autoscaling")


@dataclass(frozen=True)
class NetworkArgs:
    region: str
    public: bool  # public subnets (and an internet gateway) for an internet-facing load balancer
    vpc_id: str | None = None  # use this VPC instead of creating one
    private_subnet_ids: list[str] = field(default_factory=list)
    public_subnet_ids: list[str] = field(default_factory=list)
    cidr_block: str = "10.42.0.0/16"
    az_count: int = 2  # an ALB needs subnets in two zones

    def __post_init__(self) -> None:
        network = ipaddress.ip_network(self.cidr_block)
        if network.prefixlen > 20:
            raise ValueError(f"network cidr_block {self.cidr_block} is too small; use a /20 or larger")
        if not 2 <= self.az_count <= 4:
            raise ValueError(f"network az_count {self.az_count} must be between 2 and 4")


class Network(pulumi.ComponentResource):
    vpc_id: pulumi.Output[str]
    private_subnet_ids: pulumi.Output[list[str]]
    public_subnet_ids: pulumi.Output[list[str]]

    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("specdeploy:aws:Network", name, None, opts)
        if args.vpc_id:
            self.vpc_id = pulumi.Output.from_input(args.vpc_id)
            self.private_subnet_ids = pulumi.Output.from_input(list(args.private_subnet_ids))
            self.public_subnet_ids = pulumi.Output.from_input(list(args.public_subnet_ids))
        else:
            self._create(name, args)
        self.register_outputs({
            "vpc_id": self.vpc_id,
            "private_subnet_ids": self.private_subnet_ids,
            "public_subnet_ids": self.public_subnet_ids,
        })

    def _create(self, name: str, args: NetworkArgs) -> None:
        vpc = aws.ec2.Vpc(f"{name}-vpc", cidr_block=args.cidr_block, enable_dns_hostnames=True,
                          enable_dns_support=True, tags=tags(f"{name}-vpc"), opts=child(self))
        zones = aws.get_availability_zones_output(state="available", opts=pulumi.InvokeOutputOptions(parent=self))
        network = ipaddress.ip_network(args.cidr_block)
        subnets = list(network.subnets(new_prefix=network.prefixlen + 4))  # /20s of a /16
        private_rt = aws.ec2.RouteTable(f"{name}-private-rt", vpc_id=vpc.id, tags=tags(f"{name}-private-rt"),
                                        opts=child(self))
        private = []
        for index in range(args.az_count):
            subnet = aws.ec2.Subnet(
                f"{name}-private-{index}", vpc_id=vpc.id, cidr_block=str(subnets[index]),
                availability_zone=zones.names[index], map_public_ip_on_launch=False,
                tags=tags(f"{name}-private-{index}", tier="private"), opts=child(self),
            )
            aws.ec2.RouteTableAssociation(f"{name}-private-{index}-rt", subnet_id=subnet.id,
                                          route_table_id=private_rt.id, opts=child(self))
            private.append(subnet)
        public = []
        if args.public:
            igw = aws.ec2.InternetGateway(f"{name}-igw", vpc_id=vpc.id, tags=tags(f"{name}-igw"), opts=child(self))
            public_rt = aws.ec2.RouteTable(
                f"{name}-public-rt", vpc_id=vpc.id, routes=[{"cidr_block": "0.0.0.0/0", "gateway_id": igw.id}],
                tags=tags(f"{name}-public-rt"), opts=child(self),
            )
            for index in range(args.az_count):
                # Public subnets host only the load balancer's nodes; instances never launch here.
                subnet = aws.ec2.Subnet(
                    f"{name}-public-{index}", vpc_id=vpc.id, cidr_block=str(subnets[args.az_count + index]),
                    availability_zone=zones.names[index], map_public_ip_on_launch=False,
                    tags=tags(f"{name}-public-{index}", tier="public"), opts=child(self),
                )
                aws.ec2.RouteTableAssociation(f"{name}-public-{index}-rt", subnet_id=subnet.id,
                                              route_table_id=public_rt.id, opts=child(self))
                public.append(subnet)
        self._endpoints(name, args, vpc, private, private_rt)
        self.vpc_id = vpc.id
        self.private_subnet_ids = pulumi.Output.all(*[s.id for s in private])
        self.public_subnet_ids = pulumi.Output.all(*[s.id for s in public]) if public else pulumi.Output.from_input([])

    def _endpoints(self, name: str, args: NetworkArgs, vpc: aws.ec2.Vpc, private: list[aws.ec2.Subnet],
                   route_table: aws.ec2.RouteTable) -> None:
        aws.ec2.VpcEndpoint(
            f"{name}-s3", vpc_id=vpc.id, service_name=f"com.amazonaws.{args.region}.s3",
            vpc_endpoint_type="Gateway", route_table_ids=[route_table.id], tags=tags(f"{name}-s3"), opts=child(self),
        )
        endpoint_sg = aws.ec2.SecurityGroup(
            f"{name}-endpoints-sg", vpc_id=vpc.id, description="HTTPS from the VPC to AWS service endpoints",
            ingress=[{"protocol": "tcp", "from_port": 443, "to_port": 443, "cidr_blocks": [args.cidr_block],
                      "description": "HTTPS from inside the VPC"}],
            tags=tags(f"{name}-endpoints-sg"), opts=child(self),
        )
        for service in INTERFACE_ENDPOINTS:
            aws.ec2.VpcEndpoint(
                f"{name}-{service.replace('.', '-')}", vpc_id=vpc.id,
                service_name=f"com.amazonaws.{args.region}.{service}", vpc_endpoint_type="Interface",
                private_dns_enabled=True, subnet_ids=[s.id for s in private], security_group_ids=[endpoint_sg.id],
                tags=tags(f"{name}-{service}"), opts=child(self),
            )
