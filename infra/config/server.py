"""The sections a stack shares with the server's own config: the model, speculation, the server
process, the local platform's server; and the server config file rendered from a stack."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator

from infra.config.aws import KEEP_ALIVE_MARGIN_S, load_balancer_idle_timeout_s
from serving.config import (
    CPU_KV_CACHE_BYTES,
    ModelSection,
    NumThreads,
    Precision,
    Quantization,
    ServerConfig,
    ServiceSection,
    SpeculativePolicy,
    StrictModel,
    TensorParallelSize,
    section_field,
)

if TYPE_CHECKING:
    from infra.config.stack import StackConfig

# Where the server finds its models on a host or in a pod; the weight pull writes here.
MODEL_CACHE_DIR = "/data/models"

_URI = re.compile(r"^(s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?|file://.+)$")


def check_uri(value: str) -> str:
    if not _URI.match(value):
        raise ValueError(f"{value!r} is not a weights URI; use s3://bucket/prefix or file:///path")
    return value


class ModelSpec(StrictModel):
    """A model version in the weight store, plus the dimensions the capacity plan needs
    when its config.json cannot be read (a private bucket at review time)."""

    name: str = Field(..., min_length=1, description="Model id served in the API (`model` field).")
    source: str = Field(..., description="Weights URI of this version: s3://bucket/prefix or file:///dir.")
    dtype: Precision = Field("bf16", description="Serving precision (the capacity plan sizes the fleet by it).")
    quantization: Quantization = section_field(ModelSection, "quantization")
    tensor_parallel_size: TensorParallelSize = section_field(ModelSection, "tensor_parallel_size")
    num_threads: NumThreads = section_field(ModelSection, "num_threads")
    params_b: float | None = Field(None, gt=0, description="Parameter count in billions (capacity plan).")
    num_layers: int | None = Field(None, gt=0, description="Decoder layers (capacity plan).")
    hidden_size: int | None = Field(None, gt=0, description="Model width (capacity plan).")
    num_attention_heads: int | None = Field(None, gt=0, description="Query heads (capacity plan).")
    num_kv_heads: int | None = Field(None, gt=0, description="Key/value heads; GQA when below query heads.")
    head_dim: int | None = Field(None, gt=0, description="Per-head width; default hidden / heads.")
    vocab_size: int | None = Field(None, gt=0, description="Vocabulary size (capacity plan: embedding and lm_head, "
                                   "which every tensor-parallel rank holds whole).")
    tie_word_embeddings: bool = Field(False, description="One table for embedding and lm_head (capacity plan).")

    @field_validator("source")
    @classmethod
    def _source_uri(cls, value: str) -> str:
        return check_uri(value)


# The stack's `speculative` section is the server's, less the draft model's path (the deployment knows it).
SpeculativeSpec = SpeculativePolicy


class ServiceSpec(StrictModel):
    """The server settings a stack may set; each field is the server config's own (bounds, default)."""

    port: int = section_field(ServiceSection, "port")
    drain_grace_s: float = section_field(ServiceSection, "drain_grace_s")
    metrics_require_auth: bool = section_field(ServiceSection, "metrics_require_auth")
    header_timeout_s: float = section_field(ServiceSection, "header_timeout_s")
    keep_alive_s: float = section_field(ServiceSection, "keep_alive_s")
    body_timeout_s: float = section_field(ServiceSection, "body_timeout_s")
    max_unauthenticated_connections: int = section_field(ServiceSection, "max_unauthenticated_connections")
    max_memory_utilization: float = section_field(ModelSection, "max_memory_utilization")


class LocalSpec(StrictModel):
    state_dir: str = Field(".specdeploy/local", description="Pid, log, rendered config and weight cache.")
    host: str = Field("127.0.0.1", description="Loopback address the local server binds.")
    kv_cache_mb: int = Field(CPU_KV_CACHE_BYTES // 2**20, ge=1, description="KV cache budget on CPU, in MiB.")
    runtime: Literal["process", "container"] = Field(
        "process", description="`process`: the server runs from this checkout; `container`: from `image` (podman)."
    )
    image: str = Field("localhost/specdeploy-server:cpu", description="Server image for runtime `container`.")


def render_server_config(
    config: StackConfig,
    model_path: str = f"{MODEL_CACHE_DIR}/target",
    draft_path: str | None = f"{MODEL_CACHE_DIR}/draft",
    host: str = "0.0.0.0",
    kv_cache_bytes: int | None = None,
    api_keys_file: str | None = None,
    weights_uri: str | None = None,
) -> ServerConfig:
    """The server's config file for this stack: the single place the two schemas meet."""
    spec = config.speculative
    use_draft = config.uses_draft_model
    data = {
        "service": {
            "host": host,
            "port": config.service.port,
            "served_model_name": config.model.name,
            "metrics_require_auth": config.service.metrics_require_auth,
            "drain_grace_s": config.service.drain_grace_s,
            "header_timeout_s": config.service.header_timeout_s,
            "keep_alive_s": server_keep_alive_s(config),
            "body_timeout_s": config.service.body_timeout_s,
            "max_unauthenticated_connections": config.service.max_unauthenticated_connections,
            "api_keys_file": api_keys_file,
            "weights_uri": weights_uri,
        },
        "model": {
            "path": model_path,
            "dtype": config.model.dtype,
            # GPU platforms serve on CUDA or not at all: a CPU fallback would pass /ready and serve 100x slower.
            "device": "cuda" if config.serves_on_gpu else "auto",
            "max_memory_utilization": config.service.max_memory_utilization,
            "kv_cache_bytes": kv_cache_bytes,
            "quantization": config.model.quantization,
            "tensor_parallel_size": config.model.tensor_parallel_size,
            "num_threads": config.model.num_threads,
        },
        "scheduler": config.scheduler.model_dump(),
        "speculative": {**spec.model_dump(), "draft_model": draft_path if use_draft else None},
    }
    return ServerConfig.model_validate(data)


def server_keep_alive_s(config: StackConfig) -> float:
    """service.keep_alive_s as the server gets it: on AWS at least the load balancer's idle timeout + a margin, so
    the balancer closes idle connections before the server does (a request it sends on a connection the server is
    closing would be a 502); elsewhere the stack's value."""
    if config.platform != "aws":
        return config.service.keep_alive_s
    idle = load_balancer_idle_timeout_s(config.scheduler.request_timeout_s)
    return max(config.service.keep_alive_s, idle + KEEP_ALIVE_MARGIN_S)
