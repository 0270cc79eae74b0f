"""Who may reach the endpoint, on either cloud platform: the network exposure and TLS."""

from __future__ import annotations

import ipaddress

from pydantic import Field, field_validator, model_validator

from serving.config import StrictModel

OPEN_CIDRS = frozenset({"0.0.0.0/0", "::/0"})  # "anyone"


class AccessSpec(StrictModel):
    public: bool = Field(False, description="Internet-facing load balancer / ingress (needs TLS).")
    allowed_cidrs: list[str] = Field(
        default_factory=lambda: ["10.0.0.0/8"], min_length=1, description="Client CIDRs allowed to reach the endpoint."
    )
    certificate_arn: str | None = Field(None, description="ACM certificate for HTTPS (aws, required if public).")
    domain: str | None = Field(None, description="DNS name clients use (informational / ingress host).")
    vpc_id: str | None = Field(None, description="Existing VPC; default: create one.")
    private_subnet_ids: list[str] = Field(default_factory=list, description="Subnets for the instances.")
    public_subnet_ids: list[str] = Field(default_factory=list, description="Subnets for a public ALB.")

    @field_validator("allowed_cidrs")
    @classmethod
    def _cidrs(cls, values: list[str]) -> list[str]:
        for value in values:
            try:
                ipaddress.ip_network(value, strict=False)
            except ValueError as exc:
                raise ValueError(f"{value!r} is not a CIDR block") from exc
        return values

    @model_validator(mode="after")
    def _subnets(self) -> AccessSpec:
        if self.vpc_id and not self.private_subnet_ids:
            raise ValueError("access.private_subnet_ids is required when access.vpc_id is given")
        if self.vpc_id and self.public and not self.public_subnet_ids:
            raise ValueError("access.public_subnet_ids is required for a public service in an existing VPC")
        return self
