"""The switch that puts the Triton kernels (serving.engine.kernels.triton_kernels) on the model's CUDA path.

Off unless asked for: `enable_triton_kernels(model, block_size)` refuses by name where the kernels cannot apply
(CPU, gather attention, a cache block that is not a power of two of at least 16 tokens, a head dim over 256),
so the CPU path never changes. When on, on CUDA:

- decode and verify groups (≤ KERNEL_MAX_QUERY query tokens) attend through the paged decode kernel instead of
  FlexAttention; prefill chunks keep FlexAttention;
- a decode step captured whole attends through it too, with the new token's key joined in the kernel's merge,
  and no block mask is built;
- each layer's residual add and the MLP's RMSNorm are one kernel.

Eager and compiled steps call the same kernels, so they keep giving the same greedy tokens. torch.compile sees
each kernel as an opaque custom op (`specdeploy::paged_decode_attention`, `specdeploy::decode_with_new_key`,
`specdeploy::residual_rmsnorm`), which our CUDA graphs capture like any other launch.
"""

from __future__ import annotations

import torch

from serving.engine.batch import ForwardBatchBuilder
from serving.engine.model import KERNEL_MAX_QUERY, Transformer

_MAX_HEAD_DIM = 256


def triton_kernels_refusal(device: torch.device, paged_attention: bool, block_size: int, head_dim: int) -> str | None:
    """Why the Triton kernels cannot run this model (None: they can)."""
    if device.type != "cuda":
        return f"the Triton kernels run on CUDA only, not {device.type}"
    if not paged_attention:
        return "the Triton kernels need paged attention (kv_block_size >= 16 on CUDA)"
    if block_size < 16 or block_size & (block_size - 1):
        return f"kv_block_size {block_size} is not a power of two of at least 16 (the kernel's key tile)"
    if head_dim > _MAX_HEAD_DIM:
        return f"head_dim {head_dim} is over {_MAX_HEAD_DIM}"
    return None


@torch.library.custom_op("specdeploy::paged_decode_attention", mutates_args=())
def paged_decode_attention_op(q_pad: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                              block_tables: torch.Tensor, q_start: torch.Tensor, seq_lens: torch.Tensor, n_rep: int,
                              scale: float) -> torch.Tensor:
    from serving.engine.kernels import triton_kernels

    return triton_kernels.paged_decode_attention(q_pad, k_blocks, v_blocks, block_tables, q_start, seq_lens, n_rep,
                                                 scale)


@paged_decode_attention_op.register_fake
def _paged_decode_attention_shape(q_pad: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                                  block_tables: torch.Tensor, q_start: torch.Tensor, seq_lens: torch.Tensor,
                                  n_rep: int, scale: float) -> torch.Tensor:
    return q_pad.new_empty(q_pad.shape[0], q_pad.shape[1] * q_pad.shape[2])


@torch.library.custom_op("specdeploy::decode_with_new_key", mutates_args=())
def decode_with_new_key_op(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_blocks: torch.Tensor,
                           v_blocks: torch.Tensor, tables: torch.Tensor, ctx_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    from serving.engine.kernels import triton_kernels

    return triton_kernels.decode_with_new_key(q, k_new, v_new, k_blocks, v_blocks, tables, ctx_lens, scale)


@decode_with_new_key_op.register_fake
def _decode_with_new_key_shape(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_blocks: torch.Tensor,
                               v_blocks: torch.Tensor, tables: torch.Tensor, ctx_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


@torch.library.custom_op("specdeploy::residual_rmsnorm", mutates_args=())
def residual_rmsnorm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    from serving.engine.kernels import triton_kernels

    return triton_kernels.residual_rmsnorm(x, residual, weight, eps)


@residual_rmsnorm_op.register_fake
def _residual_rmsnorm_shape(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


def enable_triton_kernels(model: Transformer, block_size: int, builder: ForwardBatchBuilder | None = None,
                          attention: bool = True, norm: bool = True) -> None:
    """Put the Triton kernels on the model's CUDA path (before compile_steps, so the graphs capture them);
    raises ValueError naming why where they cannot apply. attention/norm: which of them. builder: the engine's
    batch builder, whose decode and verify sequences then make one attention group whatever their contexts (the
    kernel reads each sequence in place: the gather path's cap on a group's keys would cut a batch of 64 into
    dozens of kernel calls per layer), as the CPU kernel's do."""
    why = triton_kernels_refusal(model.device, model.paged_attention, block_size, model.args.head_dim)
    if why is not None:
        raise ValueError(why)
    model.set_triton_kernels(paged_decode_attention_op if attention else None,
                             decode_with_new_key_op if attention else None,
                             residual_rmsnorm_op if norm else None)
    if builder is not None:
        builder.in_place_max_q = KERNEL_MAX_QUERY if attention else 0


def disable_triton_kernels(model: Transformer, builder: ForwardBatchBuilder | None = None) -> None:
    """The model's default CUDA path again (FlexAttention, the norm apart); recompile its graphs after this."""
    model.set_triton_kernels(None, None, None)
    if builder is not None:
        builder.in_place_max_q = 0
