"""Offline preview: run infra/__main__.py under Pulumi's mocks engine and record every resource.

A review aid beside real `pulumi preview`: no CLI, no cloud, no credentials. The stack
file is loaded as the CLI would pass it (strings as they are, structures as JSON; secure
values cannot be decrypted here, so each becomes a recognisable placeholder and stays
marked secret). A recording monitor keeps each registered resource's type, name,
parent and inputs, with secret inputs masked; tests, the policy pack and the secret
scan read the same records. `specdeploy preview --stack NAME` prints them.

    result = record_stack("prod")
    result.resources      # [RecordedResource(type, name, parent, inputs, custom)], sorted
    result.of_type("kubernetes:apps/v1:Deployment")
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from infra.config import PROJECT, SECRET_MASK, StackConfig, StackFile, load_stack, stack_path

ACCOUNT_ID = "123456789012"
# Placeholder for every `secure:` value; the secret scan looks for this text in what was recorded.
SECRET_PLACEHOLDER = "preview:specdeploy-preview-secret-{key}"


@dataclass(frozen=True)
class RecordedResource:
    type: str  # type token, e.g. aws:lb/listener:Listener
    name: str  # logical name
    parent: str | None  # logical name of the parent component ("" for the stack)
    inputs: dict[str, Any]  # camelCase inputs as the engine received them; secrets masked
    custom: bool  # False for components
    secret_paths: tuple[str, ...] = ()  # dotted input paths that arrived marked secret
    outputs: dict[str, Any] = field(default_factory=dict)  # state the mocks answered (ids, ARNs, names)
    depends_on: tuple[str, ...] = ()  # logical names of the resources this one waits for
    ignore_changes: tuple[str, ...] = ()  # inputs Pulumi leaves alone after creation (owned by AWS)


@dataclass
class PreviewResult:
    stack: str
    config: StackConfig
    resources: list[RecordedResource]
    exports: dict[str, Any] = field(default_factory=dict)  # resolved stack outputs, secrets masked
    plan_text: str | None = None  # the capacity plan (AWS)

    def of_type(self, type_token: str) -> list[RecordedResource]:
        return [r for r in self.resources if r.type == type_token]

    def single(self, type_token: str) -> RecordedResource:
        """The only resource of a type (raises if there are none or several)."""
        found = self.of_type(type_token)
        if len(found) != 1:
            raise KeyError(f"{type_token}: {[r.name for r in found]}")
        return found[0]

    def one(self, type_token: str, name: str) -> RecordedResource:
        found = [r for r in self.resources if r.type == type_token and r.name == name]
        if len(found) != 1:
            raise KeyError(f"{type_token} {name}: {len(found)} recorded")
        return found[0]


def pulumi_config(stack: StackFile) -> tuple[dict[str, str], list[str]]:
    """The config map and secret keys `pulumi` would hand the program for this stack file."""
    document = yaml.safe_load(stack.path.read_text(encoding="utf-8"))
    values: dict[str, str] = {}
    secrets: list[str] = []
    for raw_key, value in document["config"].items():
        key = raw_key if ":" in raw_key else f"{PROJECT}:{raw_key}"
        if isinstance(value, dict) and set(value) == {"secure"}:
            values[key] = SECRET_PLACEHOLDER.format(key=key.split(":", 1)[1])
            secrets.append(key)
        else:
            values[key] = value if isinstance(value, str) else json.dumps(value)
    return values, secrets


def secret_placeholders(stack: StackFile) -> list[str]:
    """The placeholder values standing in for the stack's `secure:` values."""
    values, secret_keys = pulumi_config(stack)
    return [values[key] for key in secret_keys]


def _mask(value: Any, path: str, secret_paths: list[str]) -> Any:
    from pulumi.runtime import rpc

    if rpc.is_rpc_secret(value):
        secret_paths.append(path)
        return SECRET_MASK
    if isinstance(value, dict):
        return {k: _mask(v, f"{path}.{k}" if path else k, secret_paths) for k, v in value.items()}
    if isinstance(value, list):
        return [_mask(v, f"{path}[{i}]", secret_paths) for i, v in enumerate(value)]
    if value is rpc.UNKNOWN:
        return "<unknown>"
    if isinstance(value, float) and value.is_integer():
        return int(value)  # the engine sends every number as a float
    return value


def _monitor_class() -> Any:
    from pulumi.runtime import rpc
    from pulumi.runtime.mocks import MockMonitor

    class RecordingMonitor(MockMonitor):  # type: ignore[misc]
        def __init__(self, mocks: Any) -> None:
            super().__init__(mocks)
            self.records: list[RecordedResource] = []

        def RegisterResource(self, request: Any) -> Any:  # noqa: N802 - gRPC method name
            response = super().RegisterResource(request)
            if request.type != "pulumi:pulumi:Stack":
                paths: list[str] = []
                inputs = _mask(rpc.deserialize_properties(request.object), "", paths)
                registered = self.resources.get(response.urn)
                outputs = _mask(dict(registered.state), "", []) if registered else {}
                if registered and registered.id:
                    outputs["id"] = registered.id
                parent = request.parent.rsplit("::", 1)[-1] if request.parent else None
                if request.parent and request.parent.split("::")[-2].endswith("pulumi:pulumi:Stack"):
                    parent = ""
                depends = tuple(sorted({urn.rsplit("::", 1)[-1] for urn in request.dependencies}))
                self.records.append(RecordedResource(request.type, request.name, parent, inputs,
                                                     bool(request.custom), tuple(paths), outputs, depends,
                                                     tuple(request.ignoreChanges)))
            return response

    return RecordingMonitor


def _mocks_class() -> Any:
    import pulumi

    class PreviewMocks(pulumi.runtime.Mocks):  # type: ignore[misc]
        """State = inputs plus the attributes AWS would compute (ids, ARNs, names, DNS)."""

        def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str, dict[str, Any]]:
            state = dict(args.inputs)
            name = state.get("name") or args.name
            service = args.typ.split(":")[1].split("/")[0]
            state.setdefault("name", name)
            state.setdefault("arn", f"arn:aws:{service}:us-east-1:{ACCOUNT_ID}:{args.name}")
            if args.typ == "aws:lb/loadBalancer:LoadBalancer":
                state["arnSuffix"] = f"app/{args.name}/0123456789abcdef"
                internal = "internal-" if state.get("internal") else ""
                state["dnsName"] = f"{internal}{args.name}-1234567890.us-east-1.elb.amazonaws.com"
            elif args.typ == "aws:lb/targetGroup:TargetGroup":
                state["arnSuffix"] = f"targetgroup/{args.name}/0123456789abcdef"
            elif args.typ == "aws:s3/bucket:Bucket":
                state.setdefault("bucket", args.name)
                state["arn"] = f"arn:aws:s3:::{state['bucket']}"
            elif args.typ == "aws:ecr/repository:Repository":
                state["repositoryUrl"] = f"{ACCOUNT_ID}.dkr.ecr.us-east-1.amazonaws.com/{name}"
            elif args.typ == "aws:ec2/launchTemplate:LaunchTemplate":
                state["latestVersion"] = 1
            elif args.typ == "aws:cloudwatch/logGroup:LogGroup":
                state["arn"] = f"arn:aws:logs:us-east-1:{ACCOUNT_ID}:log-group:{name}"
            # S3 names buckets by their id; everything else gets a recognisable fake id.
            resource_id = state["bucket"] if args.typ == "aws:s3/bucket:Bucket" else f"{args.name}-id"
            return resource_id, state

        def call(self, args: pulumi.runtime.MockCallArgs) -> tuple[dict[str, Any], list[tuple[str, str]]]:
            return _invoke_result(args.token, dict(args.args)), []

    return PreviewMocks


def _invoke_result(token: str, args: dict[str, Any]) -> dict[str, Any]:
    """What the data sources the program reads would answer in one account and region."""
    if token == "aws:index/getAvailabilityZones:getAvailabilityZones":
        return {"names": ["us-east-1a", "us-east-1b", "us-east-1c"], "zoneIds": ["use1-az1", "use1-az2", "use1-az4"]}
    if token == "aws:ssm/getParameter:getParameter":
        ami = "ami-0123456789abcdef0"
        return {"name": args.get("name"), "type": "String", "value": ami, "insecureValue": ami}
    if token == "aws:elb/getServiceAccount:getServiceAccount":
        return {"arn": "arn:aws:iam::127311923021:root", "id": "127311923021"}
    if token == "aws:index/getCallerIdentity:getCallerIdentity":
        return {"accountId": ACCOUNT_ID, "arn": f"arn:aws:iam::{ACCOUNT_ID}:user/preview", "userId": "preview"}
    return {}


def _engine_logger() -> logging.Logger:
    """Where the engine's diagnostics go: warnings and errors only (the plan is printed by the caller)."""
    logger = logging.getLogger("specdeploy.preview.engine")
    logger.setLevel(logging.WARNING)
    return logger


def new_mocks() -> Any:
    """Mocks answering like AWS would (ids, ARNs, DNS names, data sources); for tests of single components."""
    return _mocks_class()()


@dataclass
class ProgramRun:
    """A program registered under mocks: its records (filled as the engine processes them) and exports."""

    stack: StackFile
    records: list[RecordedResource]
    exports: dict[str, Any]  # export name -> Output or plain value


def start_program(stack_name: str, stacks_dir: Path | None = None) -> ProgramRun:
    """Register the stack's resources under recording mocks.

    Call inside a running Pulumi runtime (a ``@pulumi.runtime.test`` or :func:`record_stack`):
    config and mocks live in context variables of the caller.
    """
    import pulumi

    stack = load_stack(stack_name, stacks_dir)
    mocks = _mocks_class()()
    monitor = _monitor_class()(mocks)
    pulumi.runtime.settings.ROOT.set(None)  # a fresh root stack per run, also within one process
    # Engine diagnostics (the plan, warnings) go to a logger of their own: the caller prints what it wants.
    pulumi.runtime.set_mocks(mocks, project=PROJECT, stack=stack_name, preview=False, monitor=monitor,
                             logger=_engine_logger())
    values, secret_keys = pulumi_config(stack)
    pulumi.runtime.set_all_config(values, secret_keys)
    from infra.program import run

    exports = run()
    return ProgramRun(stack, monitor.records, dict(exports))


def record_in_runtime(stack_name: str, stacks_dir: Path | None = None) -> PreviewResult:
    """Register the stack and wait until every resource is recorded and every export resolved.

    Call inside a running Pulumi runtime (a ``@pulumi.runtime.test``); :func:`record_stack`
    provides one when there is none.
    """
    import pulumi
    from pulumi.runtime.stack import wait_for_rpcs
    from pulumi.runtime.sync_await import _sync_await

    run = start_program(stack_name, stacks_dir)
    _sync_await(wait_for_rpcs(await_all_outstanding_tasks=False))
    keys = sorted(run.exports)
    outputs = [pulumi.Output.from_input(run.exports[k]) for k in keys]
    values = _sync_await(pulumi.Output.all(*outputs).future())
    secret = [_sync_await(output.is_secret()) for output in outputs]
    exports = {k: SECRET_MASK if is_secret else _mask(v, k, [])
               for k, v, is_secret in zip(keys, values or [], secret, strict=False)}
    config = run.stack.config
    plan_text = None
    if config.platform == "aws":
        from infra.capacity import plan

        plan_text = plan(config).render()
    resources = sorted(run.records, key=lambda r: (r.type, r.name))
    return PreviewResult(stack_name, config, resources, exports, plan_text)


def record_stack(stack_name: str, stacks_dir: Path | None = None) -> PreviewResult:
    """Run the program for `stack_name` to completion and return everything it registered."""
    import pulumi
    from pulumi.runtime.stack import run_pulumi_func
    from pulumi.runtime.sync_await import _sync_await

    holder: dict[str, PreviewResult] = {}

    def program() -> None:
        holder["result"] = record_in_runtime(stack_name, stacks_dir)

    pulumi.runtime.settings.ROOT.set(None)
    _sync_await(run_pulumi_func(program))
    return holder["result"]


# Inputs shown first for a resource; everything else scalar follows, up to MAX_PROPERTIES.
KEY_PROPERTIES = (
    "metadata.name", "metadata.namespace", "spec.replicas",
    "name", "bucket", "instanceType", "imageId", "internal", "port", "protocol", "sslPolicy", "certificateArn",
    "minSize", "maxSize", "desiredCapacity", "healthCheckType", "healthCheckGracePeriod", "deregistrationDelay",
    "idleTimeout", "threshold", "comparisonOperator", "evaluationPeriods", "imageTagMutability", "cidrBlock",
    "targetValue", "recurrence", "protocol", "endpoint", "policyType",
)
MAX_PROPERTIES = 8
NOISE_PREFIXES = ("tags.", "metadata.labels.", "metadata.annotations.")  # listed last
LONG_VALUE = 72  # longer strings (policies, user-data) are summarised by size


def _flatten(value: Any, path: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [item for k, v in sorted(value.items()) for item in _flatten(v, f"{path}.{k}" if path else k)]
    if isinstance(value, list):
        if all(not isinstance(v, dict | list) for v in value):
            return [(path, value)]
        return [item for i, v in enumerate(value) for item in _flatten(v, f"{path}[{i}]")]
    return [(path, value)]


def describe(resource: RecordedResource) -> str:
    """`key=value` summary of a resource's inputs, key properties first."""
    flat = [(k, v) for k, v in _flatten(resource.inputs) if v not in (None, "", [], {})]
    order = {k: i for i, k in enumerate(KEY_PROPERTIES)}
    flat = [(k, v) for k, v in flat if k not in ("apiVersion", "kind")]  # the type token says as much

    def rank(key: str) -> tuple[int, bool, str]:
        return order.get(key, len(order)), key.startswith(NOISE_PREFIXES), key

    flat.sort(key=lambda kv: rank(kv[0]))
    parts = []
    for key, value in flat[:MAX_PROPERTIES]:
        text = json.dumps(value) if not isinstance(value, str) else value
        if len(text) > LONG_VALUE:
            text = f"<{len(text)} chars>"
        parts.append(f"{key}={text}")
    more = len(flat) - MAX_PROPERTIES
    return " ".join(parts) + (f" (+{more} more)" if more > 0 else "")


def render(result: PreviewResult) -> str:
    custom = [r for r in result.resources if r.custom]
    lines = [f"stack {result.stack} ({result.config.platform}): {len(custom)} resources in "
             f"{len(result.resources) - len(custom)} components (offline preview; review `pulumi preview --diff` too)"]
    if result.plan_text:
        lines += ["", "capacity plan", *[f"  {line}" for line in result.plan_text.splitlines()]]
    lines += ["", "resources"]
    for r in result.resources:
        parent = f" [{r.parent}]" if r.parent else ""
        lines.append(f"  {r.type} {r.name}{parent}" + (f"  {describe(r)}" if r.custom else ""))
    lines += ["", "outputs"]
    for key in sorted(result.exports):
        lines.append(f"  {key} = {json.dumps(result.exports[key], sort_keys=True, default=str)}")
    return "\n".join(lines)


__all__ = ["PreviewResult", "RecordedResource", "record_stack", "render", "start_program", "stack_path"]
