"""specdeploy infrastructure: stack configuration, capacity planning, Pulumi components, operations."""
