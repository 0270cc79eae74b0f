"""One stack: the whole config (:class:`StackConfig`), its stack file, and reading it from disk or Pulumi."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from infra.config.access import OPEN_CIDRS, AccessSpec
from infra.config.alerting import AlertingSpec, SloSpec
from infra.config.aws import FleetSpec
from infra.config.kubernetes import KubernetesSpec
from infra.config.project import PROJECT, available_stacks, stack_path
from infra.config.release import SLOTS, ReleaseSpec, SlotSpec
from infra.config.server import LocalSpec, ModelSpec, ServiceSpec, SpeculativeSpec
from serving.config import ConfigError, SchedulerSection, StrictModel, format_validation_error

Platform = Literal["local", "aws", "kubernetes"]


class StackConfig(StrictModel):
    """One environment's intent. Each field is one `specdeploy:<key>` in the stack file."""

    platform: Platform = Field(..., description="Where the service runs: local, aws or kubernetes.")
    model: ModelSpec = Field(..., description="Target model: source, dtype, dimensions for planning.")
    draft: ModelSpec | None = Field(None, description="Draft model for speculative decoding.")
    speculative: SpeculativeSpec = Field(default_factory=SpeculativeSpec, description="Speculation.")
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection, description="Server limits.")
    service: ServiceSpec = Field(default_factory=ServiceSpec, description="Server process settings.")
    fleet: FleetSpec = Field(default_factory=FleetSpec, description="AWS instances and autoscaling.")
    access: AccessSpec = Field(default_factory=AccessSpec, description="Network exposure and TLS.")
    alerting: AlertingSpec = Field(default_factory=AlertingSpec, description="Alarm targets, thresholds.")
    slo: SloSpec = Field(default_factory=SloSpec, description="Targets for launch validation.")
    release: ReleaseSpec | None = Field(None, description="Blue/green slots; default: blue = model.")
    kubernetes: KubernetesSpec | None = Field(None, description="Cluster settings (platform kubernetes).")
    local: LocalSpec = Field(default_factory=LocalSpec, description="Local platform settings.")
    api_keys: str | None = Field(
        None, description="Secret: API keys `id:key[:rpm]`, comma separated (set with --secret)."
    )

    @model_validator(mode="after")
    def _coherent(self) -> StackConfig:
        if self.speculative.uses_draft_model and self.draft is None:
            raise ValueError("speculative.method is 'draft' but no `draft` model is configured")
        if self.platform == "kubernetes" and self.kubernetes is None:
            raise ValueError("platform 'kubernetes' needs a `kubernetes` section")
        if self.platform == "aws" and self.access.public and not self.access.certificate_arn:
            raise ValueError("access.public on aws needs access.certificate_arn (TLS when public)")
        if self.platform == "aws" and not self.alerting.emails and not self.alerting.https_endpoints:
            raise ValueError("platform aws needs alerting.emails or alerting.https_endpoints: "
                             "alarms would reach nobody")
        if self.platform == "kubernetes" and self.access.public and not (
            self.kubernetes and self.kubernetes.tls_secret
        ):
            raise ValueError("access.public on kubernetes needs kubernetes.tls_secret (TLS when public)")
        if self.draft is not None and self.draft.dtype != self.model.dtype:
            raise ValueError(
                f"draft.dtype ({self.draft.dtype}) differs from model.dtype ({self.model.dtype})"
            )
        if self.draft is not None and self.draft.quantization != "none":
            raise ValueError("draft.quantization: only the target's weights are quantized; leave it none")
        if self.draft is not None and self.draft.tensor_parallel_size != 1:
            raise ValueError("draft.tensor_parallel_size: the draft model is not sharded; leave it 1")
        if self.draft is not None and self.draft.num_threads != "auto":
            raise ValueError("draft.num_threads: threads are the server process's, shared by target and draft; "
                             "set model.num_threads")
        k8s = self.kubernetes
        tp = self.model.tensor_parallel_size
        if self.platform == "kubernetes" and k8s is not None and tp > 1 and k8s.gpus_per_pod < tp:
            raise ValueError(
                f"kubernetes.gpus_per_pod ({k8s.gpus_per_pod}) is below model.tensor_parallel_size "
                f"({self.model.tensor_parallel_size}): each pod needs one GPU per tensor-parallel rank"
            )
        self._check_slots_have_drafts()
        self._check_platform_access()
        return self

    def _check_slots_have_drafts(self) -> None:
        for name in SLOTS:
            slot = self.slots.slot(name)
            if slot is None:
                continue
            serving = self.for_slot(name)  # validates the slot's own server settings
            if self.platform == "local" or not serving.speculative.uses_draft_model:
                continue
            if self.draft is None:
                raise ValueError(f"release.{name}.server.speculative uses a draft model but no `draft` is configured")
            if slot.draft_version is None:
                raise ValueError(f"release.{name}.draft_version is required: speculative.method is 'draft'")

    def for_slot(self, name: str) -> StackConfig:
        """This stack as slot `name` serves it: its `release.<name>.server` keys over `scheduler` and
        `speculative`. The same object when the slot has no settings of its own."""
        spec = self.slots.slot(name)
        own = spec.server if spec is not None else None
        if own is None or (not own.scheduler and not own.speculative):
            return self
        update: dict[str, Any] = {}
        for section, model, current in (("scheduler", SchedulerSection, self.scheduler),
                                        ("speculative", SpeculativeSpec, self.speculative)):
            keys = getattr(own, section)
            if not keys:
                continue
            try:
                update[section] = model.model_validate({**current.model_dump(), **keys})
            except ValidationError as exc:
                problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
                raise ValueError(f"release.{name}.server.{section}: {problems}") from None
        return self.model_copy(update=update)

    def _check_platform_access(self) -> None:
        open_cidrs = OPEN_CIDRS & set(self.access.allowed_cidrs)
        if self.platform == "aws":
            if open_cidrs and not self.access.public:
                raise ValueError("access.allowed_cidrs opens an internal load balancer to the world; "
                                 "set access.public or list the client networks")
        if self.kubernetes is not None and self.kubernetes.routing == "gateway-api" and not open_cidrs:
            # An HTTPRoute has no portable source filter: refuse to pretend the allow-list is enforced.
            raise ValueError(
                "access.allowed_cidrs cannot be enforced by an HTTPRoute (kubernetes.routing gateway-api): "
                "restrict sources on the Gateway and set access.allowed_cidrs to [0.0.0.0/0]"
            )

    @property
    def serves_on_gpu(self) -> bool:
        """AWS fleets and Kubernetes pods with GPUs: the server must run on CUDA (`model.device: cuda`)."""
        k8s = self.kubernetes
        return self.platform == "aws" or (self.platform == "kubernetes" and k8s is not None and k8s.gpus_per_pod > 0)

    @property
    def uses_draft_model(self) -> bool:
        """Speculation on, by a draft model, and one is configured: the draft is pulled, planned for, served."""
        return self.speculative.uses_draft_model and self.draft is not None

    @property
    def slots(self) -> ReleaseSpec:
        """The release slots; a stack without `release` serves `model` from blue."""
        if self.release is not None:
            return self.release
        return ReleaseSpec(
            active="blue",
            blue=SlotSpec(
                image="specdeploy-server:latest",
                model_version=self.model.source,
                draft_version=self.draft.source if self.draft else None,
            ),
        )


# Stack-file key (camelCase, as Pulumi config keys are written) -> StackConfig field.
_KEY_ALIASES = {"apiKeys": "api_keys"}
_FIELD_KEYS = {field: key for key, field in _KEY_ALIASES.items()}
SECRET_FIELDS = frozenset({"api_keys"})
_OPTIONAL_FIELDS = frozenset(name for name, f in StackConfig.model_fields.items() if f.default is None)
SECRET_MASK = "[secret]"


def config_key(field: str) -> str:
    """The stack-file key of a StackConfig field (`api_keys` -> `apiKeys`)."""
    return _FIELD_KEYS.get(field, field)


class StackFile:
    """A parsed stack file: project config (typed), provider config, and which keys are secret."""

    def __init__(self, name: str, path: Path, config: StackConfig, providers: dict[str, Any],
                 secret_keys: frozenset[str]) -> None:
        self.name = name
        self.path = path
        self.config = config
        self.providers = providers
        self.secret_keys = secret_keys


def _parse_value(raw: Any) -> Any:
    # The CLI stores structured values as YAML; Pulumi passes them to programs as JSON text.
    if isinstance(raw, str) and raw[:1] in "[{":
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def parse_stack_mapping(raw: Mapping[str, Any], source: str = "stack") -> tuple[
        StackConfig, dict[str, Any], frozenset[str]]:
    """Validate the `config:` mapping of a stack file.

    Returns the typed config, provider settings (e.g. ``aws:region``) and the
    set of secret field names. Secure values cannot be decrypted without the
    Pulumi CLI, so they are kept as a masked placeholder.
    """
    project: dict[str, Any] = {}
    providers: dict[str, Any] = {}
    secrets: set[str] = set()
    for full_key, value in raw.items():
        namespace, sep, key = str(full_key).partition(":")
        if not sep:
            namespace, key = PROJECT, namespace
        if namespace != PROJECT:
            providers[f"{namespace}:{key}"] = value
            continue
        field = _KEY_ALIASES.get(key, key)
        if isinstance(value, Mapping) and set(value) == {"secure"}:
            secrets.add(field)
            value = SECRET_MASK
        value = _parse_value(value)
        if value in ({}, "", None) and field in _OPTIONAL_FIELDS:
            continue  # Pulumi.yaml declares optional sections with an empty default
        project[field] = value
    unknown = sorted(set(project) - set(StackConfig.model_fields))
    if unknown:
        allowed = ", ".join(f"{PROJECT}:{config_key(f)}" for f in StackConfig.model_fields)
        raise ConfigError(
            f"{source}: unknown key {', '.join(f'{PROJECT}:{k}' for k in unknown)}; allowed keys: {allowed}"
        )
    try:
        config = StackConfig.model_validate(project)
    except ValidationError as exc:
        raise ConfigError(f"{source}:\n{format_validation_error(exc, prefix=f'{PROJECT}:')}") from exc
    return config, providers, frozenset(secrets | (SECRET_FIELDS & set(project)))


def load_stack(name: str, stacks_dir: Path | None = None) -> StackFile:
    """Read and validate ``Pulumi.<name>.yaml`` of the project's stack directory (or ``stacks_dir``)."""
    path = stack_path(name, stacks_dir)
    if not path.is_file():
        known = ", ".join(available_stacks(stacks_dir)) or "none"
        raise ConfigError(f"stack {name!r}: {path} does not exist (known stacks: {known})")
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(document, dict) or not isinstance(document.get("config"), dict):
        raise ConfigError(f"{path}: expected a top-level `config:` mapping")
    extra = sorted(set(document) - {"config", "secretsprovider", "encryptedkey", "encryptionsalt"})
    if extra:
        raise ConfigError(f"{path}: unknown top-level key(s) {', '.join(extra)}")
    config, providers, secrets = parse_stack_mapping(document["config"], source=str(path))
    return StackFile(name, path, config, providers, secrets)


def from_pulumi() -> StackConfig:
    """Read the stack through the Pulumi runtime (inside `pulumi up` / mocks)."""
    import pulumi

    cfg = pulumi.Config(PROJECT)
    raw: dict[str, Any] = {}
    for field in StackConfig.model_fields:
        key = config_key(field)
        # Secret values come back in plaintext here; components must wrap them
        # with pulumi.Output.secret before they reach any resource input.
        value = cfg.get(key)
        if value is not None:
            raw[key] = value
    config, _, _ = parse_stack_mapping(raw, source=f"stack {pulumi.get_stack()}")
    return config


def masked_dump(config: StackConfig) -> dict[str, Any]:
    """The resolved config as plain data, secrets replaced by a mask (for `config show`)."""
    data = config.model_dump(mode="json")
    for field in SECRET_FIELDS:
        if data.get(field) is not None:
            data[field] = SECRET_MASK
    return {config_key(k): v for k, v in data.items()}
