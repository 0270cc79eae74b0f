"""Capacity plan: translate the model and the server limits into GPU memory, then pick hardware.

The formulas are the guide's (guide-planning-launch-operations, section 3):

- weights  = parameters x bytes per parameter (fp16/bf16 2, int8 1, int4 0.5)
- KV cache per token = 2 (K and V) x layers x kv_heads x head_dim x bytes
- KV peak  = KV per token x peak context x max concurrency ("max concurrency x peak context")
- total    = weights (+ draft weights and draft KV) + KV peak + activations + runtime overhead,
             and 15-20 % headroom on top
- batch-1 decode ceiling ~= memory bandwidth / weight bytes (every token reads all weights)

With tensor parallelism (`model.tensor_parallel_size` tp) each GPU holds the decoder layers' weights / tp
(attention and MLP split by heads and columns) plus the whole embedding and lm_head, which the engine
replicates on every rank (the replicated norms are negligible), and KV / tp (the cache is sharded by KV
head, so kv_heads must divide by tp). Activations
and the runtime are counted whole on every GPU, and the draft model (weights and KV) sits on rank 0:
the per-GPU figures are rank 0's, the fullest GPU. The instance needs at least tp GPUs.

Dimensions come from the model's config.json when it can be read, else from the stack file.
The plan then picks the cheapest catalogued instance type that fits (`fleet.instance_type:
auto`) or checks the given one, and fails with the numbers and what to change otherwise.
This module imports neither pulumi nor boto3 at top level; `specdeploy plan` starts fast.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from infra.catalog import CATALOG, CATALOG_PRICE_DATE, InstanceType, instance_names, instance_type
from infra.config import SLOTS, ModelSpec, StackConfig

GIB = 1024**3
MIB = 1024**2

BYTES_PER_PARAM: dict[str, float] = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "int4": 0.5}
# The guide asks for 15-20 % headroom over the estimated peak; the plan uses the lower bound
# because the server's own budget (max_memory_utilization) is checked separately.
HEADROOM = 0.15
# CUDA context, cuBLAS/attention workspaces and allocator fragmentation, measured on the
# order of 1-2 GiB per process on A10G..H100.
RUNTIME_OVERHEAD_BYTES = 1.5 * GIB
# Transient tensors of one engine step, in model widths per batched token: residual and norm
# outputs, q/k/v, attention output, the MLP gate/up/down intermediates (~3.5 widths each)
# and chunked logits.
ACTIVATION_WIDTHS = 16
# Host memory must hold a copy of the weights while they are staged onto the GPU, plus the
# server process itself.
HOST_MEMORY_RESERVE_BYTES = 4 * GIB

ConfigReader = Callable[[str], dict[str, Any] | None]
TP_SIZES = (1, 2, 4, 8)


class CapacityError(ValueError):
    """The model does not fit (or cannot be planned); the message has the numbers and the fix."""


@dataclass(frozen=True)
class ModelDims:
    """What the plan needs to know about one model."""

    name: str
    dtype: str
    params: float  # parameter count
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    source: str  # "config.json" or "stack file"
    quantization: str = "none"  # none, int8 or fp8: the weights' bytes; KV and activations stay in dtype
    vocab_size: int | None = None  # None: unknown (then tensor parallel plans refuse: the tables are replicated)
    tied: bool = False  # one table serves the embedding and the lm_head

    @property
    def weight_bytes(self) -> float:
        """All weights, as the engine holds them on one device."""
        return self.layer_weight_bytes + self.table_bytes

    @property
    def _matmul_bytes(self) -> float:
        # int8 and fp8 store one byte per matmul weight; their per-channel scales add ~1/hidden (ignored)
        return BYTES_PER_PARAM["int8" if self.quantization in ("int8", "fp8") else self.dtype]

    @property
    def _table_params(self) -> float:
        return (self.vocab_size or 0) * self.hidden_size * (1 if self.tied else 2)

    @property
    def layer_weight_bytes(self) -> float:
        """The decoder layers (attention, MLP, norms): what tensor parallelism splits."""
        return (self.params - self._table_params) * self._matmul_bytes

    @property
    def table_bytes(self) -> float:
        """Embedding and lm_head as the engine stores them (serving/engine/quant.py): int8 quantizes both and
        a tied table stays shared; fp8 keeps the embedding in the model dtype and gives the lm_head its own
        fp8 copy. Replicated on every tensor-parallel rank."""
        table = (self.vocab_size or 0) * self.hidden_size
        if self.quantization == "fp8":
            return table * (BYTES_PER_PARAM[self.dtype] + 1)
        return self._table_params * self._matmul_bytes

    def weight_bytes_per_rank(self, tp: int) -> float:
        if tp > 1 and self.vocab_size is None:
            raise CapacityError(
                f"capacity plan: {self.name}: model.tensor_parallel_size {tp} needs the vocabulary size (every "
                "rank holds the whole embedding and lm_head) and config.json is not readable; set "
                "model.vocab_size (and model.tie_word_embeddings) in the stack file"
            )
        return self.layer_weight_bytes / tp + self.table_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)


def weight_bytes(params: float, dtype: str) -> float:
    """Weights = parameters x bytes per parameter."""
    return params * BYTES_PER_PARAM[dtype]


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> float:
    """KV cache per token = 2 (K and V) x layers x (kv_heads x head_dim) x bytes per element."""
    return 2 * num_layers * num_kv_heads * head_dim * BYTES_PER_PARAM[dtype]


def decode_ceiling_tokens_per_s(bandwidth_gb_s: float, weight_bytes_: float) -> float:
    """Batch-1 decode upper bound: each generated token reads every weight once."""
    return bandwidth_gb_s * 1e9 / weight_bytes_


def read_local_config(uri: str) -> dict[str, Any] | None:
    """config.json of a file:// model version, or None when it is not reachable this way."""
    if not uri.startswith("file://"):
        return None
    path = Path(urlparse(uri).path if uri.startswith("file:///") else uri[len("file://"):]) / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_config_anywhere(uri: str) -> dict[str, Any] | None:
    """config.json from file:// or s3:// (boto3, the operator's credentials); None if unreachable."""
    local = read_local_config(uri)
    if local is not None or not uri.startswith("s3://"):
        return local
    try:
        import boto3
        from botocore.config import Config

        parsed = urlparse(uri)
        client = boto3.client("s3", config=Config(connect_timeout=3, read_timeout=5, retries={"max_attempts": 1}))
        key = f"{parsed.path.strip('/')}/config.json".lstrip("/")
        body = client.get_object(Bucket=parsed.netloc, Key=key)["Body"].read()
        data = json.loads(body)
    except Exception:  # noqa: BLE001 - unreachable for any reason means: use the stack file
        return None
    return data if isinstance(data, dict) else None


def _params_from_hf(hf: dict[str, Any]) -> float | None:
    """Parameter count of a Llama-family config.json (embeddings, attention, gated MLP, norms)."""
    try:
        hidden = int(hf["hidden_size"])
        layers = int(hf["num_hidden_layers"])
        heads = int(hf["num_attention_heads"])
        kv_heads = int(hf.get("num_key_value_heads", heads))
        head_dim = int(hf.get("head_dim") or hidden // heads)
        inter = int(hf["intermediate_size"])
        vocab = int(hf["vocab_size"])
    except (KeyError, TypeError, ValueError):
        return None
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp = 3 * hidden * inter
    embeddings = vocab * hidden * (1 if hf.get("tie_word_embeddings") else 2)
    return float(layers * (attention + mlp + 2 * hidden) + embeddings + hidden)


def model_dims(spec: ModelSpec, key: str, reader: ConfigReader = read_local_config) -> ModelDims:
    """Dimensions of `spec` from its config.json if readable, else from the stack file (`key`.*)."""
    hf = reader(spec.source) or {}
    from_hf = bool(hf)
    heads = hf.get("num_attention_heads", spec.num_attention_heads)
    hidden = hf.get("hidden_size", spec.hidden_size)
    layers = hf.get("num_hidden_layers", spec.num_layers)
    kv_heads = hf.get("num_key_value_heads", spec.num_kv_heads or heads)
    head_dim = hf.get("head_dim") or spec.head_dim or (hidden // heads if hidden and heads else None)
    params = spec.params_b * 1e9 if spec.params_b else _params_from_hf(hf)
    missing = [name for name, value in (
        ("params_b", params), ("num_layers", layers), ("hidden_size", hidden),
        ("num_kv_heads", kv_heads), ("head_dim", head_dim)) if not value]
    if missing:
        fields = ", ".join(f"{key}.{name}" for name in missing)
        raise CapacityError(
            f"capacity plan: cannot size {spec.name}: {fields} unknown and {spec.source}/config.json "
            "is not readable; set them in the stack file"
        )
    assert params and layers and kv_heads and head_dim and hidden  # narrowed by `missing` above
    vocab = hf.get("vocab_size", spec.vocab_size)
    tied = hf.get("tie_word_embeddings", spec.tie_word_embeddings)
    return ModelDims(spec.name, spec.dtype, float(params), int(layers), int(kv_heads), int(head_dim),
                     int(hidden), "config.json" if from_hf else "stack file", spec.quantization,
                     int(vocab) if vocab else None, bool(tied))


@dataclass(frozen=True)
class MemoryEstimate:
    """GPU memory one server needs, by the guide's terms. Bytes throughout."""

    target: ModelDims
    draft: ModelDims | None
    context_tokens: int  # peak context of one request: max input + max output (+ draft lookahead)
    concurrency: int  # requests decoded together at most
    batched_tokens: int  # token budget of one engine step
    weights: float
    draft_weights: float
    kv_per_token: float  # target + draft
    kv_peak: float
    activations: float
    runtime: float
    tp: int = 1  # model.tensor_parallel_size: GPUs the target is sharded across

    @property
    def target_weights_per_gpu(self) -> float:
        """The target's weights on one rank: its share of the layers plus the replicated tables."""
        return self.target.weight_bytes_per_rank(self.tp)

    @property
    def weights_per_gpu(self) -> float:
        """Target weights on one GPU, plus the draft's on rank 0."""
        return self.target_weights_per_gpu + self.draft_weights

    @property
    def kv_per_token_per_gpu(self) -> float:
        """KV per token on rank 0: the target's KV heads are split tp ways, the draft's are not."""
        draft_kv = self.draft.kv_bytes_per_token if self.draft else 0.0
        return (self.kv_per_token - draft_kv) / self.tp + draft_kv

    @property
    def kv_peak_per_gpu(self) -> float:
        return self.kv_per_token_per_gpu * self.context_tokens * self.concurrency

    @property
    def total(self) -> float:
        """Peak memory of the fullest GPU (rank 0); the whole server's when tp is 1."""
        return self.weights_per_gpu + self.kv_peak_per_gpu + self.activations + self.runtime

    @property
    def required(self) -> float:
        """Total with the guide's headroom: the GPU must have at least this much."""
        return self.total * (1 + HEADROOM)

    @property
    def server_budget_need(self) -> float:
        """What the server allocates inside its max_memory_utilization share."""
        return self.weights_per_gpu + self.kv_peak_per_gpu + self.activations

    @property
    def kv_per_request(self) -> float:
        return self.kv_per_token * self.context_tokens


def check_tp(dims: ModelDims, tp: int) -> None:
    """The KV cache is sharded by KV head: every rank must hold the same whole number of heads."""
    if dims.num_kv_heads % tp:
        raise CapacityError(
            f"capacity plan: {dims.name} has {dims.num_kv_heads} KV heads, which do not split evenly across "
            f"model.tensor_parallel_size {tp} ({dims.num_kv_heads} % {tp} = {dims.num_kv_heads % tp}); use a "
            f"tensor_parallel_size that divides {dims.num_kv_heads}"
        )


def estimate_memory(
    config: StackConfig, reader: ConfigReader = read_local_config, tp: int | None = None
) -> MemoryEstimate:
    """Memory of one server; `tp` overrides model.tensor_parallel_size (to ask what a larger one would need)."""
    target = model_dims(config.model, "model", reader)
    tp = config.model.tensor_parallel_size if tp is None else tp
    check_tp(target, tp)
    spec = config.speculative
    use_draft = config.uses_draft_model
    draft = model_dims(config.draft, "draft", reader) if use_draft and config.draft else None
    sched = config.scheduler
    lookahead = spec.num_draft_tokens if spec.enabled else 0
    context = sched.max_input_len + sched.max_output_len + lookahead
    kv_per_token = target.kv_bytes_per_token + (draft.kv_bytes_per_token if draft else 0.0)
    activations = sched.max_batched_tokens * target.hidden_size * BYTES_PER_PARAM[target.dtype] * ACTIVATION_WIDTHS
    return MemoryEstimate(
        target=target,
        draft=draft,
        context_tokens=context,
        concurrency=sched.max_concurrency,
        batched_tokens=sched.max_batched_tokens,
        weights=target.weight_bytes,
        draft_weights=draft.weight_bytes if draft else 0.0,
        kv_per_token=kv_per_token,
        kv_peak=kv_per_token * context * sched.max_concurrency,
        activations=activations,
        runtime=RUNTIME_OVERHEAD_BYTES,
        tp=tp,
    )


@dataclass(frozen=True)
class Fit:
    """How one instance type measures up against the estimate."""

    instance: InstanceType
    gpu_bytes: float
    server_budget: float  # max_memory_utilization x GPU memory
    problems: tuple[str, ...]

    @property
    def fits(self) -> bool:
        return not self.problems


def check_fit(estimate: MemoryEstimate, instance: InstanceType, max_memory_utilization: float) -> Fit:
    gpu = instance.gpu_memory_gib * GIB
    budget = gpu * max_memory_utilization
    problems = []
    if instance.gpus < estimate.tp:
        problems.append(f"{instance.gpus} GPU(s), model.tensor_parallel_size {estimate.tp} needs {estimate.tp}")
    if estimate.required > gpu:
        problems.append(f"needs {gib(estimate.required)} GiB with headroom, GPU has {gib(gpu)} GiB")
    if estimate.server_budget_need > budget:
        problems.append(
            f"weights + KV + activations {gib(estimate.server_budget_need)} GiB exceed the server's "
            f"budget {gib(budget)} GiB (max_memory_utilization {max_memory_utilization:g})"
        )
    host_need = estimate.weights + estimate.draft_weights + HOST_MEMORY_RESERVE_BYTES
    if host_need > instance.memory_gib * GIB:
        problems.append(f"host memory {instance.memory_gib:g} GiB < {gib(host_need)} GiB to stage the weights")
    return Fit(instance, gpu, budget, tuple(problems))


# EC2 service quotas (vCPUs of running instances) that P- and G-family instances count against.
VCPU_QUOTA_CODES = {
    ("P", "on-demand"): "L-417A185B",  # Running On-Demand P instances
    ("G", "on-demand"): "L-DB2E81BA",  # Running On-Demand G and VT instances
    ("P", "spot"): "L-7212CCBC",  # All P Spot Instance Requests
    ("G", "spot"): "L-3819A6DF",  # All G and VT Spot Instance Requests
}
RELEASE_SLOTS = ("blue", "green")


@dataclass(frozen=True)
class QuotaNeed:
    family: str  # "P" or "G"
    market: str  # "on-demand" or "spot"
    quota_code: str  # service-quotas code, service ec2
    vcpus: int  # vCPUs the fleet may run at once

    def render(self) -> str:
        return (f"{self.family} {self.market} vCPUs: {self.vcpus} at peak (quota {self.quota_code}; "
                f"aws service-quotas get-service-quota --service-code ec2 --quota-code {self.quota_code})")


@dataclass(frozen=True)
class CapacityPlan:
    stack_instance_type: str  # as written in the stack ("auto" or a type)
    estimate: MemoryEstimate
    fit: Fit
    min_size: int
    max_size: int
    max_memory_utilization: float
    candidates: tuple[Fit, ...] = field(default=())
    capacity_type: str = "on-demand"  # fleet.capacity_type: which vCPU quotas apply

    @property
    def instance(self) -> InstanceType:
        return self.fit.instance

    @property
    def decode_ceiling(self) -> float:
        # With tp GPUs each reads its shard at once (all-reduce latency not counted).
        return decode_ceiling_tokens_per_s(self.instance.bandwidth_gb_s * self.estimate.tp, self.estimate.weights)

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache the server's budget holds once weights and activations are in."""
        e = self.estimate
        free = self.fit.server_budget - e.weights_per_gpu - e.activations
        return max(0, int(free // e.kv_per_token_per_gpu))

    def same_gpu_alternatives(self, limit: int) -> list[str]:
        """Other catalogued types that also fit with the same GPU model *and GPU count*, cheapest first
        (spot pools): a one-GPU server on an eight-GPU instance pays for seven idle GPUs."""
        chosen = self.instance
        return [f.instance.name for f in self.candidates
                if f.fits and f.instance.gpu == chosen.gpu and f.instance.gpus == chosen.gpus
                and f.instance.name != chosen.name][:limit]

    def vcpu_quota_need(self, capacity_type: str) -> list[QuotaNeed]:
        """The EC2 vCPU quotas the fleet draws on at its largest: both release slots at max_size during
        a blue/green rollout. New accounts start with small (often zero) P and G quotas."""
        peak_vcpus = len(RELEASE_SLOTS) * self.max_size * self.instance.vcpus
        markets = {"on-demand": ("on-demand",), "spot": ("spot",), "mixed": ("on-demand", "spot")}[capacity_type]
        family = "P" if self.instance.family.startswith("p") else "G"
        return [QuotaNeed(family, market, VCPU_QUOTA_CODES[(family, market)], peak_vcpus) for market in markets]

    def as_dict(self) -> dict[str, Any]:
        e = self.estimate
        return {
            "instance_type": self.instance.name,
            "chosen": "auto" if self.stack_instance_type == "auto" else "given",
            "gpu": self.instance.gpu,
            "gpu_memory_gib": self.instance.gpu_memory_gib,
            "gpus": self.instance.gpus,
            "tensor_parallel_size": e.tp,
            "weights_per_gpu_gib": round(e.weights_per_gpu / GIB, 2),
            "kv_peak_per_gpu_gib": round(e.kv_peak_per_gpu / GIB, 2),
            "weights_gib": round(e.weights / GIB, 2),
            "draft_weights_gib": round(e.draft_weights / GIB, 2),
            "kv_per_token_mib": round(e.kv_per_token / MIB, 4),
            "kv_peak_gib": round(e.kv_peak / GIB, 2),
            "required_gib": round(e.required / GIB, 2),
            "decode_ceiling_tokens_per_s": round(self.decode_ceiling, 1),
            "hourly_cost_usd": [round(self.min_size * self.instance.price_per_hour, 2),
                                round(self.max_size * self.instance.price_per_hour, 2)],
            "vcpu_quotas": [{"quota_code": q.quota_code, "family": q.family, "market": q.market, "vcpus": q.vcpus}
                            for q in self.vcpu_quota_need(self.capacity_type)],
        }

    def render(self) -> str:
        """The plan as text, the way `specdeploy plan` prints it."""
        e, inst = self.estimate, self.instance
        lines = [
            f"model        {e.target.name} ({e.target.dtype}{_quantized(e.target)}, "
            f"{e.target.params / 1e9:.2f}B params, "
            f"{e.target.num_layers} layers, {e.target.num_kv_heads}x{e.target.head_dim} KV; from {e.target.source})",
        ]
        if e.draft:
            lines.append(
                f"draft        {e.draft.name} ({e.draft.params / 1e9:.2f}B params, {e.draft.num_layers} layers)"
            )
        lines += [
            f"weights      {gib(e.weights)} GiB" + (f" + draft {gib(e.draft_weights)} GiB" if e.draft else ""),
            f"KV cache     {e.kv_per_token / MIB:.3f} MiB/token x {e.context_tokens} tokens = "
            f"{gib(e.kv_per_request)} GiB/request; x {e.concurrency} concurrent = {gib(e.kv_peak)} GiB peak",
            f"activations  {gib(e.activations)} GiB ({e.batched_tokens} tokens/step); runtime {gib(e.runtime)} GiB",
        ]
        if e.tp > 1:
            lines.append(
                f"parallel     tensor_parallel_size {e.tp}: per GPU weights {gib(e.target.layer_weight_bytes)}/{e.tp} "
                f"(layers) + {gib(e.target.table_bytes)} (embedding and lm_head, on every GPU) = "
                f"{gib(e.target_weights_per_gpu)} GiB"
                + (f" (+ draft {gib(e.draft_weights)} GiB on rank 0)" if e.draft else "")
                + f", KV {e.target.num_kv_heads // e.tp} of {e.target.num_kv_heads} KV heads = "
                f"{gib(e.kv_peak_per_gpu)} GiB peak; activations and runtime on every GPU"
            )
        lines += [
            f"total        {gib(e.total)} GiB; with {HEADROOM:.0%} headroom {gib(e.required)} GiB per GPU",
            f"instance     {inst.name} ({self._why_chosen()}): "
            f"{inst.gpus}x {inst.gpu} {inst.gpu_memory_gib:g} GiB, {inst.bandwidth_gb_s:g} GB/s, "
            f"${inst.price_per_hour:.3f}/h",
            f"server       budget {gib(self.fit.server_budget)} GiB (max_memory_utilization "
            f"{self.max_memory_utilization:g}); KV room {self.kv_capacity_tokens} tokens",
            f"decode       batch-1 ceiling ~{self.decode_ceiling:.0f} tokens/s (bandwidth"
            + (f" x {e.tp} GPUs" if e.tp > 1 else "") + " / weight bytes)",
            f"fleet        {self.min_size}..{self.max_size} instances: ${self.min_size * inst.price_per_hour:.2f}"
            f"..${self.max_size * inst.price_per_hour:.2f}/h on demand (prices {CATALOG_PRICE_DATE}, us-east-1)",
        ]
        lines += [f"quota        {need.render()}" for need in self.vcpu_quota_need(self.capacity_type)]
        if inst.gpus > e.tp:
            lines.append(f"note         the server uses {e.tp} GPU(s) (model.tensor_parallel_size); "
                         f"{inst.gpus - e.tp} of {inst.gpus} GPUs stay idle")
        if e.tp > 1:
            lines.append(f"note         tensor parallel: the server starts {e.tp} processes, one per GPU (NCCL); "
                         "rank 0 schedules and samples, every rank holds its share of heads, MLP and KV cache "
                         "and a whole copy of the embedding and lm_head")
        return "\n".join(lines)

    def _why_chosen(self) -> str:
        if self.stack_instance_type != "auto":
            return "given"
        return "cheapest that fits" + (f" with >= {self.estimate.tp} GPUs" if self.estimate.tp > 1 else "")


def render_candidates(candidates: tuple[Fit, ...]) -> str:
    """Every catalogued type against the estimate, cheapest first."""
    lines = [f"{'type':<14} {'gpu':<18} {'GiB':>4} {'$/h':>7}  fits"]
    for f in candidates:
        verdict = "yes" if f.fits else f"no: {f.problems[0]}"
        lines.append(f"{f.instance.name:<14} {f.instance.gpu:<18} {f.instance.gpu_memory_gib:>4g} "
                     f"{f.instance.price_per_hour:>7.3f}  {verdict}")
    return "\n".join(lines)


def _quantized(dims: ModelDims) -> str:
    return f", {dims.quantization} weights" if dims.quantization != "none" else ""


def gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def _max_concurrency_for(estimate: MemoryEstimate, instance: InstanceType, mmu: float) -> int:
    """Largest max_concurrency that would fit this type, all else equal (0 if none does)."""
    best = 0
    for concurrency in range(1, estimate.concurrency + 1):
        trial = replace(estimate, concurrency=concurrency, kv_peak=estimate.kv_per_request * concurrency)
        if not check_fit(trial, instance, mmu).fits:
            break
        best = concurrency
    return best


def _does_not_fit(config: StackConfig, estimate: MemoryEstimate, fits: list[Fit], given: str | None) -> CapacityError:
    mmu = config.service.max_memory_utilization
    e = estimate
    pool = [f for f in fits if f.instance.name == given] if given else fits
    biggest = max(pool, key=lambda f: (f.gpu_bytes, -f.instance.price_per_hour))
    where = f"fleet.instance_type {given}" if given else f"any catalogued type (largest: {biggest.instance.name})"
    split = f" -> {gib(e.target_weights_per_gpu)} GiB per GPU at tensor_parallel_size {e.tp}" if e.tp > 1 else ""
    lines = [
        f"capacity plan: {e.target.name} does not fit {where}",
        f"  weights {gib(e.weights)} GiB{split} + draft {gib(e.draft_weights)} GiB + KV peak "
        f"{gib(e.kv_peak_per_gpu)} GiB per GPU "
        f"({e.kv_per_token_per_gpu / MIB:.3f} MiB/token x {e.context_tokens} tokens x {e.concurrency} requests) "
        f"+ activations {gib(e.activations)} GiB + runtime {gib(e.runtime)} GiB = {gib(e.total)} GiB; "
        f"x{1 + HEADROOM:g} headroom = {gib(e.required)} GiB",
    ]
    lines += [f"  {biggest.instance.name}: {problem}" for problem in biggest.problems]
    lines.append("  to fit, change one of:")
    tiers: dict[float, tuple[InstanceType, int]] = {}  # GPU memory size -> cheapest type that fits, concurrency
    for f in sorted(pool, key=lambda f: f.instance.price_per_hour):
        fix = _max_concurrency_for(e, f.instance, mmu)
        if fix and f.instance.gpu_memory_gib not in tiers:
            tiers[f.instance.gpu_memory_gib] = (f.instance, fix)
    best = 0
    for inst, fix in sorted(tiers.values(), key=lambda t: t[0].price_per_hour):
        if fix <= best:
            continue  # a cheaper type already allows more
        best = fix
        lines.append(f"    - scheduler.max_concurrency {e.concurrency} -> {fix} "
                     f"(fits {inst.name}, ${inst.price_per_hour:.2f}/h)")
    lines.append(f"    - scheduler.max_input_len / max_output_len (peak context {e.context_tokens} tokens)")
    if e.draft:
        lines.append("    - speculative.method ngram (drops the draft model's weights and KV cache)")
    lines.append("    - a smaller or quantized model (model.quantization int8 / fp8, model.dtype; weights are the "
                 "fixed cost)")
    if given:
        ok = [f.instance.name for f in sorted(fits, key=lambda f: f.instance.price_per_hour) if f.fits]
        if ok:
            lines.append(f"    - fleet.instance_type auto (cheapest that fits: {ok[0]})")
    lines += _tp_suggestion(config, e)
    return CapacityError("\n".join(lines))


def _tp_suggestion(config: StackConfig, estimate: MemoryEstimate) -> list[str]:
    """The smallest larger model.tensor_parallel_size that fits some catalogued type, if any does."""
    mmu = config.service.max_memory_utilization
    if estimate.target.vocab_size is None:
        return ["    - shard it (model.tensor_parallel_size): set model.vocab_size (and model.tie_word_embeddings) "
                "so the plan can size each GPU's copy of the embedding and lm_head"]
    for tp in (size for size in TP_SIZES if size > estimate.tp):
        if estimate.target.num_kv_heads % tp:
            continue
        trial = replace(estimate, tp=tp)
        ok = sorted((item for item in CATALOG if check_fit(trial, item, mmu).fits), key=lambda i: i.price_per_hour)
        if ok:
            return [f"    - model.tensor_parallel_size {estimate.tp} -> {tp} (cheapest that fits: {ok[0].name}, "
                    f"{ok[0].gpus} GPUs, ${ok[0].price_per_hour:.2f}/h)"]
    return ["    - no catalogued type fits even at model.tensor_parallel_size 8"]


def plan(config: StackConfig, reader: ConfigReader = read_local_config) -> CapacityPlan:
    """The capacity plan of a stack; raises CapacityError when nothing (or the given type) fits."""
    estimate = estimate_memory(config, reader)
    mmu = config.service.max_memory_utilization
    fits = [check_fit(estimate, item, mmu) for item in CATALOG]
    requested = config.fleet.instance_type
    if requested == "auto":
        ok = sorted((f for f in fits if f.fits), key=lambda f: (f.instance.price_per_hour, f.instance.name))
        if not ok:
            raise _does_not_fit(config, estimate, fits, None)
        chosen = ok[0]
    else:
        if instance_type(requested) is None:
            raise CapacityError(
                f"fleet.instance_type {requested!r} is not in the instance catalog (infra/catalog.py); "
                f"use auto or one of: {', '.join(instance_names())}"
            )
        chosen = next(f for f in fits if f.instance.name == requested)
        if not chosen.fits:
            raise _does_not_fit(config, estimate, fits, requested)
    _check_slot_settings(config, chosen.instance, reader)
    return CapacityPlan(requested, estimate, chosen, config.fleet.min_size, config.fleet.max_size, mmu,
                        tuple(sorted(fits, key=lambda f: f.instance.price_per_hour)), config.fleet.capacity_type)


def _check_slot_settings(config: StackConfig, instance: InstanceType, reader: ConfigReader) -> None:
    """Both slots run on the planned instance type: one whose own server settings (release.<slot>.server,
    e.g. a higher max_concurrency) need more memory than it has is refused, naming the slot."""
    for slot in SLOTS:
        serving = config.for_slot(slot)
        if serving is config:
            continue
        fit = check_fit(estimate_memory(serving, reader), instance, config.service.max_memory_utilization)
        if not fit.fits:
            raise CapacityError(
                f"capacity plan: release.{slot}.server does not fit {instance.name}, the type the stack's own "
                f"settings are planned on: {'; '.join(fit.problems)}. Lower it, or plan the stack for it "
                "(set the same keys in the stack's section, or fleet.instance_type)"
            )


def weight_cache_gib(estimate: MemoryEstimate) -> int:
    """Disk the weight cache needs: both versions of target and draft during a model swap."""
    return math.ceil(2 * (estimate.weights + estimate.draft_weights) / GIB)
