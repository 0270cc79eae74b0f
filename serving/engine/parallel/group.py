"""Rank 0's side of tensor parallelism: start the worker ranks, drive them each step, notice when one dies.

    start()  spawn ranks 1..tp-1 (torch.multiprocessing, spawn) → TCPStore on loopback → process group
    ready()  after rank 0 loaded its shard: tell the workers the KV cache size, wait until they loaded theirs
    send_step(seqs)  before every forward of the target model: the step's sequences to every worker
    all_reduce(t)    the reduce hook of rank 0's layers
    shutdown()       "stop" to every worker, join, terminate stragglers, destroy the group

Any failure — a worker process that exited, a pipe that broke, a collective that raised or timed out —
marks the group failed, terminates the remaining workers and raises RankFailedError (an EngineDeadError:
the engine stops and /ready answers 503). A failed group never runs another step, so a lost rank can
never produce a wrong answer, only a refused one.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from collections.abc import Sequence
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from serving.engine.batch import SequenceInput
from serving.engine.config import EngineConfig
from serving.engine.cpu_threads import usable_cores
from serving.engine.model import ModelArgs
from serving.engine.parallel.shard import check_shardable
from serving.engine.parallel.worker import WorkerSpec, attach_reduce, init_group, run_worker
from serving.engine.types import EngineDeadError

log = logging.getLogger(__name__)

_JOIN_S = 10.0  # shutdown: how long a worker gets to leave after "stop" before it is terminated
_REAP_S = 0.5  # after a failed collective: how long to wait for a dying rank's exit, to name it


class RankFailedError(EngineDeadError):
    """A tensor-parallel rank died or a collective failed: the engine cannot run another step."""


class TensorParallelGroup:
    def __init__(self, procs: list[Any], conns: list[Connection], store: dist.Store, timeout_s: float) -> None:
        self.procs, self.conns, self.store = procs, conns, store
        self.timeout_s = timeout_s
        self.failure: str | None = None
        self.closed = False
        atexit.register(self.shutdown)

    @property
    def world_size(self) -> int:
        return len(self.procs) + 1

    @property
    def worker_pids(self) -> list[int]:
        return [int(p.pid) for p in self.procs]

    # ---- start-up ---------------------------------------------------------------------------------

    @classmethod
    def start(
        cls, *, world_size: int, model_dir: str, dtype: torch.dtype, device: torch.device, max_model_len: int,
        quantization: str, block_size: int, num_threads: int, timeout_s: float,
    ) -> TensorParallelGroup:
        """Spawn ranks 1..world_size-1 and form the process group with them (rank 0 is this process)."""
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group already exists in this process: "
                               "one tensor-parallel engine per process")
        backend = "nccl" if device.type == "cuda" else "gloo"
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        ctx = mp.get_context("spawn")
        procs, conns = [], []
        group = None
        try:
            for rank in range(1, world_size):
                spec = WorkerSpec(
                    rank=rank, world_size=world_size, backend=backend, store_port=store.port, timeout_s=timeout_s,
                    model_dir=model_dir, dtype=dtype, device=f"cuda:{rank}" if device.type == "cuda" else "cpu",
                    max_model_len=max_model_len, quantization=quantization, block_size=block_size,
                    num_threads=num_threads, parent_pid=os.getpid(),
                )
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=run_worker, args=(spec, theirs), name=f"specdeploy-tp-rank{rank}",
                                   daemon=True)
                proc.start()
                theirs.close()
                procs.append(proc)
                conns.append(ours)
            group = cls(procs, conns, store, timeout_s)
            for rank, pid in group.expect("started"):
                log.info("tensor parallel: rank %d is pid %d", rank, pid)
            spec0 = WorkerSpec(rank=0, world_size=world_size, backend=backend, store_port=store.port,
                               timeout_s=timeout_s, model_dir=model_dir, dtype=dtype, device=str(device),
                               max_model_len=max_model_len, quantization=quantization, block_size=block_size,
                               num_threads=num_threads, parent_pid=os.getppid())
            init_group(spec0, store)
            group.expect("joined")
            log.info("tensor parallel: %d ranks joined (%s)", world_size, backend)
            return group
        except BaseException:
            if group is not None:
                group.shutdown()
            else:
                for proc in procs:
                    proc.terminate()
                    proc.join(_JOIN_S)
            raise

    def ready(self, model: torch.nn.Module, num_blocks: int) -> None:
        """Rank 0's shard is loaded: hook its all-reduces, size every rank's cache, wait for the workers."""
        attach_reduce(model, self.all_reduce)
        for conn in self.conns:
            conn.send(("cache", num_blocks))
        self.expect("ready")

    def expect(self, kind: str) -> list[tuple[int, Any]]:
        """Wait for message `kind` from every worker, watching that each is still alive (start-up only)."""
        got = []
        deadline = time.monotonic() + max(self.timeout_s, 600.0)  # loading a large shard takes a while
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), start=1):
            while not conn.poll(0.2):
                if not proc.is_alive():
                    raise self._fail(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                                     f"{proc.exitcode} during start-up")
                if time.monotonic() > deadline:
                    raise self._fail(f"tensor-parallel rank {rank} sent no {kind!r} in time")
            try:
                message, payload = conn.recv()
            except EOFError:
                raise self._fail(f"tensor-parallel rank {rank} closed its pipe during start-up") from None
            if message == "error":
                raise self._fail(f"tensor-parallel rank {rank} failed to start:\n{payload}")
            if message != kind:
                raise self._fail(f"tensor-parallel rank {rank} sent {message!r}, expected {kind!r}")
            got.append((rank, payload))
        return got

    # ---- each step --------------------------------------------------------------------------------

    def send_step(self, seqs: Sequence[SequenceInput]) -> None:
        """Hand the step's sequences to every worker; they run the same forward alongside rank 0's."""
        self.check_alive()
        message = ("step", [(s.token_ids, s.start_pos, s.block_table) for s in seqs])
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send(message)
            except OSError as exc:
                raise self._fail(f"tensor-parallel rank {rank}: cannot send the step ({exc!r})") from exc

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        try:
            dist.all_reduce(tensor)
        except Exception as exc:  # a peer died (connection closed) or the collective timed out
            for proc in self.procs:  # a rank killed a moment ago may not be reaped yet: give it a moment
                proc.join(_REAP_S)
            self.check_alive()  # names the dead rank when there is one
            raise self._fail(f"tensor-parallel all-reduce failed: {exc}") from exc
        return tensor

    def check_alive(self) -> None:
        if self.failure is not None:
            raise RankFailedError(self.failure)
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                raise self._fail(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")

    def _fail(self, reason: str) -> RankFailedError:
        """Record the failure and end the group (every rank must stop: the others are waiting on the lost one)."""
        if self.failure is None:
            self.failure = reason
            log.error("%s; stopping the other ranks", reason)
        self.shutdown(graceful=False)
        return RankFailedError(reason)

    # ---- shutdown ---------------------------------------------------------------------------------

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every worker (no orphans) and leave the process group. Idempotent.

        graceful: ask the workers to stop and give them _JOIN_S; after a failure they are killed at once
        (a worker waiting in a collective on a lost peer reads no message)."""
        if self.closed:
            return
        self.closed = True
        for conn, proc in zip(self.conns, self.procs, strict=True):
            try:
                if graceful:
                    conn.send(("stop", None))
                elif proc.is_alive():
                    proc.kill()
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + _JOIN_S
        for proc in self.procs:
            proc.join(max(deadline - time.monotonic(), 0.1))
            if proc.is_alive():  # wedged in a collective with a dead peer
                proc.kill()
                proc.join(_JOIN_S)
        for conn in self.conns:
            conn.close()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a group whose peers are gone may fail to tear down cleanly
                log.warning("tensor parallel: destroying the process group failed", exc_info=True)
        atexit.unregister(self.shutdown)


def start_workers(
    config: EngineConfig, args: ModelArgs, dtype: torch.dtype, device: torch.device, max_model_len: int
) -> TensorParallelGroup | None:
    """Ranks 1..tp-1 for the engine's config (None when tensor_parallel_size is 1); refuses what cannot run."""
    tp = config.tensor_parallel_size
    if tp == 1:
        return None
    check_shardable(args, tp)
    if device.type == "cuda" and torch.cuda.device_count() < tp:
        raise ValueError(f"tensor_parallel_size {tp} needs {tp} CUDA devices; {torch.cuda.device_count()} visible")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"tensor parallelism runs on cpu (gloo) or cuda (nccl), not {device.type}")
    # each rank its share of the cores unless the config names a count (rank 0 decides alike: engine.from_config)
    threads = config.num_threads if isinstance(config.num_threads, int) else max(1, usable_cores() // tp)
    return TensorParallelGroup.start(
        world_size=tp, model_dir=config.model, dtype=dtype, device=device, max_model_len=max_model_len,
        quantization=config.quantization, block_size=config.kv_block_size, num_threads=threads,
        timeout_s=config.collective_timeout_s,
    )
