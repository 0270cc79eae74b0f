"""Engine configuration: the server config's model/scheduler/speculative sections, under the same names.

Every field shared with the server config is borrowed from its section (default, bounds, description, and
name: `model` is the section's `path`), so the two cannot drift; :meth:`EngineConfig.from_server_config` maps
the sections onto it. Only what the server config has no key for is declared here (tokenizer, seed, the tensor
parallel collective timeout).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from serving.config import (
    CompileMode,
    DecodeAttentionMode,
    Dtype,
    ModelSection,
    NumThreads,
    Quantization,
    SchedulerSection,
    ServerConfig,
    SpeculativeSection,
    StrictModel,
    WeightPacking,
    check_step_budget,
    section_field,
)

# The engine speculates exactly as the server's `speculative` section says.
SpeculativeConfig = SpeculativeSection


class EngineConfig(StrictModel):
    model: str = section_field(ModelSection, "path")
    dtype: Dtype = section_field(ModelSection, "dtype")
    device: str = section_field(ModelSection, "device")
    tokenizer: str | None = Field(None, description="Tokenizer directory; default: the model directory.")
    kv_block_size: int = section_field(SchedulerSection, "kv_block_size")
    kv_cache_bytes: int | None = section_field(ModelSection, "kv_cache_bytes")
    max_memory_utilization: float = section_field(ModelSection, "max_memory_utilization")
    max_concurrency: int = section_field(SchedulerSection, "max_concurrency")
    max_batched_tokens: int = section_field(SchedulerSection, "max_batched_tokens")
    # Prompt + output at most; None: the checkpoint's own positions.
    max_model_len: int | None = section_field(ModelSection, "max_model_len")
    quantization: Quantization = section_field(ModelSection, "quantization")
    compile: CompileMode = section_field(ModelSection, "compile")
    cpu_weight_packing: WeightPacking = section_field(ModelSection, "cpu_weight_packing")
    cpu_decode_attention: DecodeAttentionMode = section_field(ModelSection, "cpu_decode_attention")
    max_queue: int = section_field(SchedulerSection, "max_queue")
    enable_prefix_caching: bool = section_field(SchedulerSection, "enable_prefix_caching")
    seed: int = Field(0, description="Seeds the generators of requests that bring no seed.")
    num_threads: NumThreads = section_field(ModelSection, "num_threads")
    speculative: SpeculativeSection = Field(default_factory=SpeculativeSection)
    # KV heads (and MLP width) must divide evenly: checked against the checkpoint when the engine starts
    tensor_parallel_size: int = section_field(ModelSection, "tensor_parallel_size")
    collective_timeout_s: float = Field(
        60.0, gt=0, description="Tensor parallel: a collective (or a rank joining) that takes longer fails the "
        "engine (not ready) instead of hanging it.")

    @model_validator(mode="after")
    def _step_budget(self) -> EngineConfig:
        check_step_budget(self.max_concurrency, self.max_batched_tokens, ("max_concurrency", "max_batched_tokens"))
        return self

    @classmethod
    def from_server_config(cls, config: ServerConfig) -> EngineConfig:
        model, scheduler = config.model, config.scheduler
        return cls(
            model=model.path,
            tensor_parallel_size=model.tensor_parallel_size,
            dtype=model.dtype,
            device=model.device,
            kv_block_size=scheduler.kv_block_size,
            kv_cache_bytes=model.kv_cache_bytes,
            max_memory_utilization=model.max_memory_utilization,
            max_concurrency=scheduler.max_concurrency,
            max_batched_tokens=scheduler.max_batched_tokens,
            # Only an explicit limit: the engine otherwise takes the checkpoint's own positions (its admission
            # checks each request's context against them; the server's max_input_len / max_output_len are the API's).
            max_model_len=model.max_model_len,
            quantization=model.quantization,
            num_threads=model.num_threads,
            compile=model.compile,
            cpu_weight_packing=model.cpu_weight_packing,
            cpu_decode_attention=model.cpu_decode_attention,
            max_queue=scheduler.max_queue,
            enable_prefix_caching=scheduler.enable_prefix_caching,
            speculative=config.speculative,
        )
