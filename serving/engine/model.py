"""A Llama-family decoder (Llama, Qwen2, Mistral) over a flat batch and a paged KV cache.

    embed → [RMSNorm → attention (fused qkv, RoPE, paged KV) → RMSNorm → SwiGLU] × L → RMSNorm → lm_head

One forward runs every token of the step — prefill chunks, decode tokens and verify tokens of many
sequences — in a single pass. Logits are computed only for the rows the step samples from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from serving.engine.batch import AttentionGroup, ForwardBatch
from serving.engine.kernels.paged_attention import CapturedDecode, paged_attention, paged_block_mask
from serving.engine.kv_cache import KVCache
from serving.engine.rope import apply_rope, build_rope_cache, compute_inv_freq

# CPU: groups whose queries are at most this long (decode, and verify steps of up to 15 drafts) attend through the
# kernel that reads the paged cache in place (serving.engine.kernels.cpu_attention). Longer ones (prefill chunks) gather
# for SDPA. Measured on the demo target (docs/benchmarks/log.md), the kernel took 0.30-0.42 of gather + SDPA's time for
# decode, 0.50-0.73 at 3-9 query tokens of one sequence, 0.76-0.92 at 9-16 tokens of 16 sequences
KERNEL_MAX_QUERY = 16

SUPPORTED_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one this engine runs."""


@dataclass
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    max_position_embeddings: int
    rope: dict[str, Any] = field(default_factory=dict)  # rope_theta, rope_type and its parameters
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    model_type: str = "llama"
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None  # the checkpoint's dtype
    sliding_window: int | None = None  # Mistral: attention window; max_model_len is capped to it (exact)

    @property
    def n_rep(self) -> int:
        return self.n_heads // self.n_kv_heads

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        model_type = cfg.get("model_type", "")
        archs = cfg.get("architectures") or []
        if model_type not in SUPPORTED_MODEL_TYPES:
            name = archs[0] if archs else model_type or "unknown"
            raise UnsupportedModelError(
                f"unsupported architecture {name!r} (model_type {model_type!r}); "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES.values())}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {cfg.get('hidden_act')!r}; only silu")
        n_heads = int(cfg["num_attention_heads"])
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        rope.setdefault("rope_type", rope.pop("type", "default"))
        if model_type == "qwen2" and cfg.get("use_sliding_window"):
            raise UnsupportedModelError("Qwen2 with use_sliding_window=true is not supported")
        eos = cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            dim=int(cfg["hidden_size"]),
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // n_heads),
            intermediate_size=int(cfg["intermediate_size"]),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope=rope,
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            model_type=model_type,
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            sliding_window=(cfg.get("sliding_window") or None) if model_type == "mistral" else None,
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32, scale in the model dtype: the reference's rounding order (F.rms_norm is
        # slower on CPU for small rows: it upcasts and decomposes)
        if x.dtype == torch.float32:  # sum * (1/dim) rather than mean(): mean adds a dtype round trip per call
            mean_square = x.pow(2).sum(-1, keepdim=True).mul_(1.0 / x.shape[-1])
            return self.weight * (x * torch.rsqrt(mean_square.add_(self.eps)))
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.n_rep = args.n_rep
        qkv_dim = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = nn.Linear(args.dim, qkv_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=args.o_bias)
        self.scale = args.head_dim**-0.5
        # FlexAttention straight from the paged cache (serving.engine.kernels.paged_attention) instead of gather + SDPA;
        # Transformer.set_paged_attention turns it on (the engine does on CUDA)
        self.paged = False
        # CPU: decode and verify groups (queries of at most KERNEL_MAX_QUERY tokens) attend through a C++ kernel
        # reading the paged cache in place (serving.engine.kernels.cpu_attention; Transformer.set_decode_kernel); None:
        # gather + SDPA
        self.decode_kernel: Callable[..., torch.Tensor] | None = None
        # CUDA, paged: decode and verify groups through a Triton kernel with the decode kernel's signature
        # (serving.engine.kernels.gpu_kernels; Transformer.set_triton_kernels); None: FlexAttention
        self.paged_decode_kernel: Callable[..., torch.Tensor] | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch | None,
        cache: KVCache | None,
        layer: int,
        decode: CapturedDecode | None = None,
    ) -> torch.Tensor:
        num_tokens, n_q, n_kv = x.shape[0], self.n_heads, self.n_kv_heads
        qkv = self.wqkv(x).view(num_tokens, n_q + 2 * n_kv, self.head_dim)
        qk = apply_rope(qkv[:, : n_q + n_kv], cos, sin)  # q and k heads rotated together
        q, k, v = qk[:, :n_q], qk[:, n_q:], qkv[:, n_q + n_kv :]  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        if decode is not None:  # a decode step captured whole: attention is part of the graph
            return self.wo(decode.attend(q, k, v, layer))
        if batch is None or cache is None:
            # compiled step (serving.engine.compile): attention is an opaque op that reads the step's batch and
            # cache from its context, so the graph around it has static shapes
            return self.wo(torch.ops.specdeploy.attention(q, k, v, layer))
        return self.wo(self.attend(q, k, v, batch, cache, layer))

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, cache: KVCache, layer: int
    ) -> torch.Tensor:
        """Write the step's K/V and attend every group: [T, Hq, D] (and [T, Hkv, D] x 2) -> [T, Hq * D]."""
        cache.write(layer, batch.slot_mapping, k, v)
        if len(batch.groups) == 1:
            return self.attend_group(q, batch.groups[0], cache, layer)
        out = torch.empty(q.shape[0], self.n_heads * self.head_dim, dtype=q.dtype, device=q.device)
        for group in batch.groups:
            out[group.token_start : group.token_end] = self.attend_group(q, group, cache, layer)
        return out

    def attend_group(self, q: torch.Tensor, group: AttentionGroup, cache: KVCache, layer: int) -> torch.Tensor:
        """Padded attention for one group; returns [group tokens, Hq * D]."""
        g, max_q, d = group.num_seqs, group.max_q, self.head_dim
        if group.uniform:
            q_pad = q[group.token_start : group.token_end]  # [G * max_q, Hq, D]
        else:
            assert group.query_index is not None
            q_pad = q.index_select(0, group.query_index)
        if self.paged and max_q <= KERNEL_MAX_QUERY and self.paged_decode_kernel is not None:
            assert group.q_start is not None and group.seq_lens is not None
            k_blocks, v_blocks = cache.layer_blocks(layer)
            o = self.paged_decode_kernel(q_pad, k_blocks, v_blocks, group.block_tables, group.q_start,
                                         group.seq_lens, self.n_rep, self.scale)
        elif self.paged:
            o = self.attend_paged(q_pad.view(g, max_q, self.n_heads, d).transpose(1, 2), group, cache, layer)
        elif max_q <= KERNEL_MAX_QUERY and self.decode_kernel is not None:
            assert group.q_start is not None and group.seq_lens is not None
            k_blocks, v_blocks = cache.layer_blocks(layer)
            o = self.decode_kernel(q_pad, k_blocks, v_blocks, group.block_tables, group.q_start, group.seq_lens,
                                   self.n_rep, self.scale)
        else:
            o = self.attend_gathered(q_pad, group, cache, layer)
        if not group.uniform:
            assert group.valid_index is not None
            o = o.index_select(0, group.valid_index)
        return o

    def attend_gathered(self, q_pad: torch.Tensor, group: AttentionGroup, cache: KVCache, layer: int) -> torch.Tensor:
        """Gather the group's context into [G, Hkv, K, D] and run SDPA: [G * max_q, Hq, D] -> [G * max_q, Hq * D]."""
        g, max_q, hkv, d = group.num_seqs, group.max_q, self.n_kv_heads, self.head_dim
        # GQA without repeating K/V: the n_rep query heads of a KV head become extra query rows
        q_pad = q_pad.view(g, max_q, hkv, self.n_rep, d).permute(0, 2, 3, 1, 4)  # [G, Hkv, n_rep, max_q, D]
        q_pad = q_pad.reshape(g, hkv, self.n_rep * max_q, d)
        k_ctx, v_ctx = cache.gather(layer, group.block_tables, group.key_len)  # [G, Hkv, K, D]
        o = F.scaled_dot_product_attention(q_pad, k_ctx, v_ctx, attn_mask=group.mask, scale=self.scale)
        o = o.view(g, hkv, self.n_rep, max_q, d).permute(0, 3, 1, 2, 4)  # [G, max_q, Hkv, n_rep, D]
        return o.reshape(g * max_q, hkv * self.n_rep * d)

    def attend_paged(self, q_pad: torch.Tensor, group: AttentionGroup, cache: KVCache, layer: int) -> torch.Tensor:
        """FlexAttention over the cache blocks in place: [G, Hq, max_q, D] -> [G * max_q, Hq * D]."""
        if group.block_mask is None:  # once per step: every layer reads the same blocks
            group.block_mask = paged_block_mask(group, cache.num_blocks, cache.block_size)
        k_blocks, v_blocks = cache.layer_blocks(layer)
        o = paged_attention(q_pad, k_blocks, v_blocks, group.block_mask, self.scale)  # [G, Hq, max_q, D]
        return o.transpose(1, 2).reshape(group.num_seqs * group.max_q, self.n_heads * self.head_dim)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.intermediate_size = args.intermediate_size
        self.w13 = nn.Linear(args.dim, 2 * args.intermediate_size, bias=args.mlp_bias)  # gate and up, fused
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).split(self.intermediate_size, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    # tensor parallelism (serving.engine.parallel) sets an in-place all-reduce here; None on one device
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    # CUDA: (x, residual, weight, eps) -> (RMSNorm(x + residual), x + residual) in one kernel for the MLP's norm
    # (serving.engine.kernels.gpu_kernels; Transformer.set_triton_kernels); None: the two apart
    residual_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch | None,
        cache: KVCache | None,
        layer: int,
        decode: CapturedDecode | None = None,
    ) -> torch.Tensor:
        attended = self.attention(self.attention_norm(x), cos, sin, batch, cache, layer, decode)
        if self.reduce is not None:  # tensor parallel: sum the ranks' partial row-parallel outputs
            attended = self.reduce(attended)
        if self.residual_norm is not None and self.reduce is None:
            normed, h = self.residual_norm(attended, x, self.ffn_norm.weight, self.ffn_norm.eps)
            return h + self.feed_forward(normed)
        h = x + attended
        mlp = self.feed_forward(self.ffn_norm(h))
        return h + (mlp if self.reduce is None else self.reduce(mlp))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, max_model_len: int) -> None:
        super().__init__()
        self.args = args
        self.max_model_len = max_model_len
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.paged_attention = False  # set_paged_attention
        # decode steps captured whole attend through this (serving.engine.kernels.gpu_kernels) instead of FlexAttention
        self.captured_decode_kernel: Callable[..., torch.Tensor] | None = None
        self.quantization = "none"  # set by the loader: none, int8 or fp8 (serving.engine.quant)
        self.rope_cos = torch.empty(0)  # [max_model_len, D] fp32, indexed by position
        self.rope_sin = torch.empty(0)
        self.build_rope(None)

    def set_paged_attention(self, on: bool) -> None:
        """Attend from the paged cache in place (FlexAttention, serving.engine.kernels.paged_attention), not gather
        + SDPA."""
        self.paged_attention = on
        for layer in self.layers:
            assert isinstance(layer, TransformerBlock)
            layer.attention.paged = on

    def set_decode_kernel(self, kernel: Callable[..., torch.Tensor] | None) -> None:
        """CPU: attend decode and verify groups through `kernel` (serving.engine.kernels.cpu_attention), or gather +
        SDPA (None)."""
        for layer in self.layers:
            assert isinstance(layer, TransformerBlock)
            layer.attention.decode_kernel = kernel

    def set_triton_kernels(self, paged_decode: Callable[..., torch.Tensor] | None,
                           captured_decode: Callable[..., torch.Tensor] | None,
                           residual_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """CUDA: decode and verify groups, decode steps captured whole and the MLP's residual + norm through these
        kernels (serving.engine.kernels.gpu_kernels.enable_triton_kernels checks where they apply); None: the
        default."""
        self.captured_decode_kernel = captured_decode
        for layer in self.layers:
            assert isinstance(layer, TransformerBlock)
            layer.attention.paged_decode_kernel = paged_decode
            layer.residual_norm = residual_norm

    @property
    def dtype(self) -> torch.dtype:
        """Activation (and KV cache) dtype: quantized weights keep norms in it."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def build_rope(self, device: torch.device | None) -> None:
        args = self.args
        inv_freq, scaling = compute_inv_freq(
            args.head_dim, args.rope, args.max_position_embeddings, self.max_model_len
        )
        cos, sin = build_rope_cache(inv_freq, scaling, self.max_model_len)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Run the batch through all layers, writing its K/V; returns hidden states [T, dim]."""
        return self.forward_tokens(batch.input_ids, batch.positions, batch, cache)

    def forward_tokens(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch | None, cache: KVCache | None,
        decode: CapturedDecode | None = None,
    ) -> torch.Tensor:
        """The layers over [T] tokens; batch and cache None: attention through the compiled step's op, or with
        decode, attention inside the graph (a decode step captured whole)."""
        x = self.tok_embeddings(input_ids)  # [T, dim]
        cos = self.rope_cos[positions].to(x.dtype).unsqueeze(1)  # [T, 1, D]
        sin = self.rope_sin[positions].to(x.dtype).unsqueeze(1)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, batch, cache, i, decode)
        return x

    def forward_decode(
        self, input_ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, ctx_lens: torch.Tensor,
        cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A decode step (one token per row) that reads the cache and does not write it: hidden [G, dim] and the
        new K and V [L, G, Hkv, D], for the caller to store. tables [G, W] int32, ctx_lens [G]: each row's block
        table and the tokens cached before its new one. Static shapes only, so it compiles and captures whole."""
        decode = CapturedDecode(*cache.all_layer_blocks(), tables, ctx_lens, self.args.head_dim**-0.5,
                                self.captured_decode_kernel)
        hidden = self.forward_tokens(input_ids, positions, None, None, decode)
        return hidden, torch.stack(decode.new_k), torch.stack(decode.new_v)

    def compute_logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head for the selected rows only; fp32 logits [N, vocab]."""
        return self.output(self.norm(hidden.index_select(0, rows))).float()
