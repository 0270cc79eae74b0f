"""A tensor-parallel rank >= 1: its shard of the model and of the KV cache, driven step by step by rank 0.

Rank 0 (the server process) owns the scheduler, the block bookkeeping, sampling and the draft model. Per
forward it sends each worker the step's sequences (tokens, start position, block table) over a pipe; the
worker builds the same ForwardBatch (the builder is deterministic) and runs its shard of the layers, meeting
the other ranks in the two all-reduces of every layer. It computes no logits.

A worker ends on "stop", when the pipe closes, when rank 0's process is gone (it checks its parent while
idle), or on any error (a collective that fails or times out): it never outlives the server.
"""

from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from serving.engine.batch import ForwardBatchBuilder, SequenceInput

log = logging.getLogger(__name__)

_IDLE_POLL_S = 0.5

# One step's sequences on the wire: (token ids, start position, block table) per sequence.
StepMessage = list[tuple[list[int], int, list[int]]]


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    world_size: int
    backend: str  # gloo (CPU) or nccl (CUDA)
    store_port: int  # rank 0's TCPStore on 127.0.0.1
    timeout_s: float  # collectives (and joining the group)
    model_dir: str
    dtype: torch.dtype
    device: str  # "cpu" or "cuda:<rank>"
    max_model_len: int
    quantization: str
    block_size: int
    num_threads: int
    parent_pid: int


def init_group(spec: WorkerSpec, store: dist.Store) -> None:
    """Join the process group every rank's all-reduces run in (the default group of this process)."""
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists in this process: "
                           "one tensor-parallel engine per process")
    dist.init_process_group(spec.backend, store=store, rank=spec.rank, world_size=spec.world_size,
                            timeout=timedelta(seconds=spec.timeout_s))


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum the tensor over the ranks, in place (the reduce hook of serving.engine.model.TransformerBlock)."""
    dist.all_reduce(tensor)
    return tensor


def attach_reduce(model: torch.nn.Module, reduce: Any) -> None:
    for layer in model.layers:  # type: ignore[union-attr]
        layer.reduce = reduce


def run_worker(spec: WorkerSpec, conn: Connection) -> None:
    """The worker process's entry point (spawned by serving.engine.parallel.group)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{spec.rank} %(levelname)s %(message)s")
    try:
        torch.set_num_threads(spec.num_threads)
        if spec.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(spec.device))
        conn.send(("started", os.getpid()))
        store = dist.TCPStore("127.0.0.1", spec.store_port, spec.world_size, is_master=False,
                              timeout=timedelta(seconds=spec.timeout_s))
        init_group(spec, store)
        conn.send(("joined", None))
        kind, num_blocks = conn.recv()  # rank 0 sizes the cache (after loading its own shard)
        assert kind == "cache", kind
        model, cache = _load(spec, num_blocks)
        conn.send(("ready", None))
    except BaseException:  # reported to rank 0, which refuses to start
        _send_quietly(conn, ("error", traceback.format_exc()))
        return
    try:
        _serve(spec, conn, model, cache)
    except BaseException:
        log.exception("tensor-parallel rank %d failed; exiting", spec.rank)
        os._exit(1)  # a failed collective can leave the group's threads wedged: leave at once
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _load(spec: WorkerSpec, num_blocks: int) -> tuple[torch.nn.Module, Any]:
    from serving.engine.kv_cache import KVCache
    from serving.engine.loader import load_model

    device = torch.device(spec.device)
    model = load_model(spec.model_dir, spec.dtype, device, spec.max_model_len, spec.quantization,  # type: ignore[arg-type]
                       shard=(spec.rank, spec.world_size))
    attach_reduce(model, all_reduce)
    model.set_paged_attention(device.type == "cuda")  # the same attention path as rank 0 (LLMEngine)
    args = model.args
    cache = KVCache(args.n_layers, num_blocks, spec.block_size, args.n_kv_heads, args.head_dim, model.dtype, device)
    return model, cache


@torch.inference_mode()
def _serve(spec: WorkerSpec, conn: Connection, model: Any, cache: Any) -> None:
    builder = ForwardBatchBuilder(spec.block_size, model.args.n_rep, model.device, model.dtype)
    while True:
        if not conn.poll(_IDLE_POLL_S):
            if os.getppid() != spec.parent_pid:  # rank 0 is gone (killed): nobody will drive this rank again
                log.warning("tensor-parallel rank %d: rank 0 (pid %d) is gone; exiting", spec.rank, spec.parent_pid)
                return
            continue
        try:
            kind, payload = conn.recv()
        except EOFError:
            return
        if kind == "stop":
            return
        if kind != "step":
            raise RuntimeError(f"unexpected message {kind!r} from rank 0")
        seqs = [SequenceInput(tokens, start, table, []) for tokens, start, table in payload]
        model(builder.build(seqs), cache)


def _send_quietly(conn: Connection, message: tuple[str, Any]) -> None:
    try:
        conn.send(message)
    except (OSError, ValueError):
        pass
