"""The server's configuration file: its shape, validation and environment overrides.

The file mirrors the deployment guide (step 3)::

    service:     {host: 0.0.0.0, port: 8000}
    model:       {path: /data/models/target, dtype: auto, max_memory_utilization: 0.85}
    scheduler:   {max_concurrency: 64, max_input_len: 4096, max_output_len: 1024,
                  max_queue: 128, request_timeout_s: 60}
    speculative: {enabled: true, method: draft, draft_model: /data/models/draft,
                  num_draft_tokens: 12, adaptive: true}

Operators never write it by hand for a deployment: ``infra.config`` renders it
from the stack file. Every limit is defined once, here: the stack schema embeds
these sections (or borrows single fields with :func:`section_field`) and the
engine's ``EngineConfig`` is built from them.

Environment variables ``SPECDEPLOY__<SECTION>__<KEY>`` override the file; they are
read by pydantic-settings and validated like the file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from copy import copy
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict
from pydantic_settings.sources.utils import parse_env_vars

# Where the settings below are measured (every run, by date)
MEASURED_IN = "docs/benchmarks/log.md"
ENV_PREFIX = "SPECDEPLOY__"
ENV_DELIMITER = "__"

# A precision the stack names for its fleet (the capacity plan needs one); the server and engine also take `auto`.
Precision = Literal["fp32", "fp16", "bf16"]
Dtype = Literal["auto", Precision]
# auto: the engine measures at start-up (serving.engine.cpu_threads)
NumThreads = Annotated[int, Field(ge=1, le=1024)] | Literal["auto"]


class StrictModel(BaseModel):
    """Unknown keys are errors: a misspelt limit must never be silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def section_field(section: type[BaseModel], name: str) -> Any:
    """A field of a config section, with its default, bounds and description, for reuse elsewhere.

    The stack schema and the engine config declare ``port: int = section_field(ServiceSection, "port")``
    instead of repeating ``Field(8000, ge=1, le=65535, ...)``.
    """
    return copy(section.model_fields[name])


def _power_of_two(value: int) -> int:
    if value & (value - 1):
        raise ValueError(f"must be a power of two, got {value}")
    return value


def check_step_budget(max_concurrency: int, max_batched_tokens: int, names: tuple[str, str]) -> None:
    """One engine step decodes a token for every running request, so its budget must cover them all."""
    if max_batched_tokens < max_concurrency:
        raise ValueError(
            f"{names[1]} ({max_batched_tokens}) is below {names[0]} ({max_concurrency}): "
            "every running request decodes one token per step"
        )


class ServiceSection(StrictModel):
    host: str = Field("0.0.0.0", description="Address the server listens on; prefer a private address.")
    port: int = Field(8000, ge=1, le=65535, description="TCP port of the HTTP API.")
    served_model_name: str = Field(
        "default", min_length=1, description="Model id clients send in `model` and see in /v1/models."
    )
    api_keys_env: str = Field(
        "SPECDEPLOY_API_KEYS",
        description="Environment variable holding API keys (`id:key[:rpm]`, comma separated).",
    )
    api_keys_file: str | None = Field(
        None, description="File mounted from a secret store with one `id:key[:rpm]` per line."
    )
    metrics_require_auth: bool = Field(False, description="Require an API key for GET /metrics.")
    max_body_bytes: int = Field(1_048_576, ge=1024, description="Largest accepted request body (413 above).")
    header_timeout_s: float = Field(
        10.0, gt=0, description="A connection's request headers must be complete this long after it opened (or after "
        "its previous response), else it is closed: a client sending a byte at a time holds no connection forever.",
    )
    keep_alive_s: float = Field(
        5.0, gt=0, le=7200, description="How long an idle keep-alive connection stays open between requests (the "
        "next request's headers then have service.header_timeout_s more). Behind a load balancer that reuses its "
        "connections to the server it must outlast the balancer's idle timeout, or the balancer can send a request "
        "on a connection the server is closing and the client gets a 502: the AWS stacks render it so.",
    )
    body_timeout_s: float = Field(
        30.0, gt=0, description="A request body's next part must arrive within this long of the previous one, else a "
        "408 and the connection closes.",
    )
    max_unauthenticated_connections: int = Field(
        256, ge=1, description="Open connections that have not yet made a request with a valid API key; at the cap a "
        "new connection evicts the oldest of them that is idle or still sending headers, or gets a 503.",
    )
    drain_grace_s: float = Field(
        30.0, gt=0, le=3600, description="After SIGTERM, how long in-flight requests may run before exit."
    )
    weights_uri: str | None = Field(
        None, description="If set, the server pulls and verifies this model version into model.path at start."
    )


# Load-time weight quantization (serving/engine/quant.py); one definition for the server, engine and planner.
Quantization = Literal["none", "int8", "fp8"]
# GPUs one server shards its model across (attention/KV heads and MLP split); the planner sizes per GPU by it.
TensorParallelSize = Literal[1, 2, 4, 8]
# auto: compiled and CUDA-graph-captured small steps on CUDA, eager on CPU (where compiling barely pays, measured)
CompileMode = Literal["auto", "on", "off"]
# auto: on CPU, each model's matmul weights packed for oneDNN unless 1- and 16-token steps measure it worse
WeightPacking = Literal["auto", "on", "off"]
# auto: on CPU, a draft model's greedy steps run as one compiled graph where that measures faster at start-up
DraftRolloutMode = Literal["auto", "on", "off"]
RolloutWrapper = Literal["cpp", "python"]
# auto: on CPU, decode attention through a C++ kernel reading the paged cache in place where that measures faster
DecodeAttentionMode = Literal["auto", "on", "off"]
# auto: torch's large CPU buffers (weights, KV cache) in transparent huge pages where the kernel gives them
HugePagesMode = Literal["auto", "on", "off"]


# The KV cache budget on CPU where the config sets none (the local stacks' local.kv_cache_mb default too).
CPU_KV_CACHE_BYTES = 256 * 2**20


class ModelSection(StrictModel):
    path: str = Field(..., min_length=1, description="Directory with config.json, safetensors and tokenizer.")
    dtype: Dtype = Field(
        "auto", description="Weight and activation precision. auto: fp32 on CPU (the decode-attention kernel is "
        "fp32-only, and fp32 keeps greedy tokens identical between verify and decode steps), on CUDA the "
        "checkpoint's torch_dtype, bf16 where it names none.",
    )
    num_threads: NumThreads = Field(
        "auto", description="CPU: torch intra-op threads of the server process. auto: one core is kept for the HTTP "
        "server, tokenizer and scheduler, and among the counts left the one with the fastest 1- and 16-token steps "
        "measured at start-up is taken; OMP_NUM_THREADS, where set, is used instead. Ignored on CUDA.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="`auto` = CUDA when present.")
    max_memory_utilization: float = Field(
        0.85, gt=0.1, le=0.95, description="Share of GPU memory the server may use (weights + KV cache)."
    )
    kv_cache_bytes: int | None = Field(
        None, gt=0, description="Explicit KV cache budget in bytes (CPU, or to override the GPU sizing). Unset: "
        f"{CPU_KV_CACHE_BYTES // 2**20} MiB on CPU; on CUDA what max_memory_utilization leaves after the weights.",
    )
    max_model_len: int | None = Field(
        None, gt=0, description="Context limit; default max_input_len + max_output_len."
    )
    quantization: Quantization = Field(
        "none", description="Weights quantized at load: int8 weight-only per channel; fp8 (e4m3) needs a GPU of "
        "compute capability >= 8.9 and is refused elsewhere. The checkpoint on disk is unchanged.",
    )
    tensor_parallel_size: TensorParallelSize = Field(
        1, description="GPUs the model is sharded across (1, 2, 4 or 8; KV heads must divide evenly). The capacity "
        "plan and the platforms size and provision for it; the server starts one process per GPU (gloo ranks on "
        "CPU) and shards heads, KV cache and MLP across them.",
    )
    compile: CompileMode = Field(
        "auto", description="Small steps (decode, verify) padded to token-count buckets and compiled with "
        "torch.compile at start-up, before ready; CUDA graphs per bucket on CUDA. Faster steps for a longer start-up. "
        "auto: on for CUDA, off for CPU; on: also on CPU (each bucket measured at warm-up, kept only where it beats "
        "eager); off: eager everywhere. Measured: " + MEASURED_IN + "#model-compile.",
    )
    cpu_weight_packing: WeightPacking = Field(
        "auto", description="CPU: matmul weights reordered once at load into oneDNN's blocked layout, which makes "
        "multi-row steps (verify, batched decode) cheaper but can make a one-token step dearer on some CPUs. auto: "
        "per model (target, draft), kept unless its one- and 16-token steps measured at start-up come out worse "
        "than dense's; on: always; "
        "off: plain nn.Linear. CPU, fp32/bf16, unquantized, without tensor parallelism or model.compile on. "
        "Measured: " + MEASURED_IN + "#model-cpu-weight-packing.",
    )
    cpu_decode_attention: DecodeAttentionMode = Field(
        "auto", description="CPU: decode steps and verify steps (up to 16 query tokens) attend through a small C++ "
        "kernel that reads the paged KV cache in place instead of gathering it into a copy for SDPA (built at "
        "start-up with the host's C++ compiler and cached, or a portable build shipped in the image): less memory "
        "traffic, for a half-second build at start-up. auto: per model (target, draft), kept where decode groups "
        "measured at start-up take <= 0.95 of the gather path's time; on: wherever it applies (refused by name where "
        "it cannot: no compiler and no portable build, not CPU, not fp32, tensor parallel); off: gather + SDPA. "
        "Measured: " + MEASURED_IN + "#model-cpu-decode-attention.",
    )
    cpu_huge_pages: HugePagesMode = Field(
        "auto", description="CPU: torch's buffers of 2 MiB and more (weights, KV cache) in transparent huge pages, "
        "fewer TLB misses for the memory every decoding step reads; set as THP_MEM_ALLOC_ENABLE before torch loads "
        "(serving/engine/huge_pages.py). auto: on where the kernel's THP mode is always or madvise and model.device is "
        "not cuda; on: always asked for; off: never. THP_MEM_ALLOC_ENABLE in the environment wins. Measured: "
        + MEASURED_IN + "#model-cpu-huge-pages.",
    )


class SchedulerSection(StrictModel):
    max_concurrency: int = Field(64, ge=1, le=4096, description="Requests decoded together at most.")
    max_input_len: int = Field(4096, ge=1, description="Longest accepted prompt, in tokens (400 above).")
    max_output_len: int = Field(1024, ge=1, description="Largest max_tokens a request may ask for.")
    max_queue: int = Field(128, ge=0, description="Requests waiting beyond max_concurrency (429 above).")
    request_timeout_s: float = Field(60.0, gt=0, le=3600, description="End-to-end limit per request (504).")
    max_batched_tokens: int = Field(
        2048, ge=16, description="Token budget of one engine step (prefill chunks + decodes + drafts)."
    )
    kv_block_size: Annotated[int, AfterValidator(_power_of_two)] = Field(
        16, ge=1, le=256, description="Tokens per KV cache block (a power of two)."
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse the KV blocks of prompt prefixes already computed (shared system prompts)."
    )

    @model_validator(mode="after")
    def _step_budget(self) -> SchedulerSection:
        check_step_budget(
            self.max_concurrency, self.max_batched_tokens, ("scheduler.max_concurrency", "scheduler.max_batched_tokens")
        )
        return self


# the most draft tokens a step may verify (speculative.num_draft_tokens)
MAX_DRAFT_TOKENS = 16
# the shortest speculative.draft_context: after a restart on half of it, the draft still has room for a
# rollout of the most drafts and its catch-up
MIN_DRAFT_CONTEXT = 4 * MAX_DRAFT_TOKENS

# the conventional name of a draft's token map: `draft_token_map: auto` uses it when the draft ships one
TOKEN_MAP_NAME = "token_map.json"


def check_token_map_name(name: str) -> None:
    """speculative.draft_token_map is named relative to the draft model's directory and stays inside it."""
    parts = PurePosixPath(name).parts
    if not name or name.startswith("/") or ".." in parts or "\\" in name:
        raise ValueError(f"speculative.draft_token_map {name!r} must be a file name inside the draft model's "
                         "directory (relative, without '..'), so that it travels with the draft's weights")


class SpeculativePolicy(StrictModel):
    """How to speculate, without where the draft model lives: the stack file's `speculative` section.
    The server's section adds the draft model's path, which only the deployment knows."""

    enabled: bool = Field(False, description="Turn speculative decoding on.")
    method: Literal["draft", "ngram"] = Field("draft", description="Proposer: a draft model or n-gram lookup.")
    num_draft_tokens: int = Field(
        12, ge=1, le=MAX_DRAFT_TOKENS, description="k: the most draft tokens a sequence verifies in one step (the "
        "adaptive policy picks 0..k per step): a larger k gains more tokens a step when drafts are accepted and "
        "costs more draft work when they are not. Measured: " + MEASURED_IN + "#speculative-num-draft-tokens.",
    )
    adaptive: bool = Field(True, description="Choose k per step from measured cost and acceptance (0 allowed).")
    ngram_min: int = Field(1, ge=1, le=8, description="Shortest suffix matched by the n-gram proposer.")
    ngram_max: int = Field(4, ge=1, le=16, description="Longest suffix matched by the n-gram proposer.")
    draft_rollout: DraftRolloutMode = Field(
        "auto", description="CPU, method draft: the draft model's catch-up token(s) and its k greedy drafts run "
        "as one graph compiled by inductor at start-up, before ready (needs a C++ compiler), instead of one eager "
        "forward per token: cheaper drafting for a lone sequence, for a compile at start-up. auto: kept where the "
        "start-up measurement finds it faster; on: always; off: never. "
        "Measured: " + MEASURED_IN + "#speculative-draft-rollout.",
    )
    draft_rollout_wrapper: RolloutWrapper = Field(
        "cpp", description="What calls the compiled rollout's kernels: cpp, inductor's C++ wrapper (cheaper "
        "rollouts, for a first compile on a host about ten times longer; later starts reuse inductor's cache), or "
        "python, its Python wrapper (where start-up time matters more). "
        "Measured: " + MEASURED_IN + "#speculative-draft-rollout-wrapper.",
    )

    draft_token_map: str | None = Field(
        "auto", description="Method draft: a JSON list of token ids, a file in the draft model's directory (named "
        "relative to it, so it travels and is verified with the draft's weights). The draft proposes only those "
        "tokens and its lm_head computes only their rows, which makes each draft step cheaper; speculation stays "
        "lossless. Build one with `python -m serving.engine.spec.token_map build`. auto: the draft directory's "
        f"{TOKEN_MAP_NAME} when its manifest.json lists it (or the directory has no manifest); none (or null): the "
        "full vocabulary. Measured: " + MEASURED_IN + "#speculative-draft-token-map.",
    )

    draft_context: int | Literal["auto"] | None = Field(
        "auto", description="Method draft: the most tokens of a sequence the draft model reads. Once a sequence "
        "(with the drafts of a step) would pass it, the draft reads only its latest half of this many tokens, at "
        "positions counted from there, and goes on from there; speculation stays lossless, only what the draft "
        "proposes changes. A draft taken past the context it was trained on proposes worse, and its proposals "
        "are rejected. auto: the draft's max_position_embeddings where that is shorter than the target's "
        "context, else the whole sequence; none (or null): always the whole sequence. "
        "Measured: " + MEASURED_IN + "#speculative-draft-context.",
    )

    @property
    def uses_draft_model(self) -> bool:
        return self.enabled and self.method == "draft"

    @field_validator("draft_context", mode="before")
    @classmethod
    def _draft_context(cls, value: object) -> object:
        if isinstance(value, str) and value.lower() == "none":
            return None
        if isinstance(value, int) and not isinstance(value, bool) and value < MIN_DRAFT_CONTEXT:
            raise ValueError(f"speculative.draft_context {value} is too short: the draft must keep room for "
                             f"a step's drafts after restarting on half of it (at least {MIN_DRAFT_CONTEXT})")
        return value

    @field_validator("draft_token_map")
    @classmethod
    def _token_map_inside_the_draft(cls, name: str | None) -> str | None:
        if name is None or name.lower() == "none":
            return None
        if name != "auto":
            check_token_map_name(name)
        return name

    @model_validator(mode="after")
    def _ngram_range(self) -> SpeculativePolicy:
        if self.ngram_min > self.ngram_max:
            raise ValueError(
                f"speculative.ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})"
            )
        return self


class SpeculativeSection(SpeculativePolicy):
    draft_model: str | None = Field(None, description="Directory of the draft model (method draft).")

    @model_validator(mode="after")
    def _draft_present(self) -> SpeculativeSection:
        if self.uses_draft_model and not self.draft_model:
            raise ValueError("speculative.draft_model is required when speculative.method is 'draft'")
        return self


class ServerConfig(StrictModel):
    service: ServiceSection = ServiceSection()
    model: ModelSection
    scheduler: SchedulerSection = SchedulerSection()
    speculative: SpeculativeSection = SpeculativeSection()

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len or self.scheduler.max_input_len + self.scheduler.max_output_len

    @model_validator(mode="after")
    def _limits_fit(self) -> ServerConfig:
        if self.model.max_model_len is not None and self.model.max_model_len < self.scheduler.max_input_len:
            raise ValueError(
                f"model.max_model_len ({self.model.max_model_len}) is below "
                f"scheduler.max_input_len ({self.scheduler.max_input_len})"
            )
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message names the key."""


def format_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """One line per problem, each naming the dotted key and, for choices, the allowed values."""
    lines = []
    for err in exc.errors():
        key = ".".join(str(part) for part in err["loc"])
        key = f"{prefix}{key}" if key else prefix.rstrip(".") or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "literal_error":
            expected = err.get("ctx", {}).get("expected", "")
            msg = f"invalid value {err.get('input')!r}; allowed: {expected}"
        elif msg.startswith("Value error, "):
            msg = msg.removeprefix("Value error, ")
        lines.append(f"{key}: {msg}")
    return "\n".join(lines)


class _ServerEnvironment(ServerConfig, BaseSettings):
    """Where pydantic-settings reads the overrides: ``SPECDEPLOY__SCHEDULER__MAX_QUEUE=32``."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_DELIMITER, env_parse_none_str="null", extra="forbid"
    )


class _EnvironmentSource(EnvSettingsSource):
    """The environment source reading a given mapping (``os.environ`` by default), so tests pass their own."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(_ServerEnvironment)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(self._environ, self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str)


def _check_override_names(environ: Mapping[str, str]) -> None:
    """Every ``SPECDEPLOY__`` variable must name one known key; a typo is never ignored."""
    for name in environ:
        if not name.upper().startswith(ENV_PREFIX):
            continue
        path = name[len(ENV_PREFIX) :].lower().split(ENV_DELIMITER)
        if len(path) != 2 or not all(path):
            raise ConfigError(f"{name}: expected {ENV_PREFIX}<SECTION>{ENV_DELIMITER}<KEY>")
        section, key = path
        field = ServerConfig.model_fields.get(section)
        if field is None:
            raise ConfigError(f"{name}: unknown section {section!r}; allowed: {', '.join(ServerConfig.model_fields)}")
        model = field.annotation
        keys = model.model_fields if isinstance(model, type) and issubclass(model, BaseModel) else {}
        if key not in keys:
            raise ConfigError(f"{name}: unknown key {section}.{key}")


def environment_overrides(environ: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """The ``SPECDEPLOY__<SECTION>__<KEY>`` variables as ``{section: {key: value}}``, not yet validated."""
    _check_override_names(environ)
    return _EnvironmentSource(environ)()


def _merge(data: dict[str, Any], overrides: Mapping[str, Mapping[str, Any]], source: str) -> dict[str, Any]:
    for section, values in overrides.items():
        current = data.setdefault(section, {})
        if not isinstance(current, dict):
            raise ConfigError(f"{source}: section {section!r} is not a mapping, so the environment cannot override it")
        current.update(values)
    return data


def load_server_config(path: str | Path, environ: Mapping[str, str] | None = None) -> ServerConfig:
    """Read, override from the environment, and validate a server config file."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: no such file") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    data = _merge(data, environment_overrides(os.environ if environ is None else environ), str(path))
    try:
        return ServerConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{path}:\n{format_validation_error(exc)}") from exc
