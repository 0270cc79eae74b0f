"""The synchronous engine: `step()` = schedule → forward → sample → update, one batch at a time.

Not thread-safe: one thread drives it (the async wrapper's loop thread, a benchmark, a test).
"""

from __future__ import annotations

import collections
import copy
import logging
import random
import time
from pathlib import Path
from typing import Any

import torch

from serving.engine.batch import ForwardBatch, ForwardBatchBuilder, SequenceInput
from serving.engine.compile import CompiledForward, buckets_up_to
from serving.engine.config import EngineConfig
from serving.engine.cpu_threads import ThreadsDecision, usable_cores
from serving.engine.cpu_threads import choose as choose_threads
from serving.engine.grammar import RequestGrammar, apply_grammar_masks
from serving.engine.kernels.cpu_attention import AttentionDecision
from serving.engine.kernels.cpu_attention import choose as choose_attention
from serving.engine.kernels.cpu_attention import unsupported_reason as attention_unsupported
from serving.engine.kernels.cpu_linear import PackingDecision, choose, unsupported_reason
from serving.engine.kv_cache import BlockManager, KVCache, kv_bytes_per_block
from serving.engine.loader import dtype_reason, load_model, read_model_args, resolve_dtype
from serving.engine.model import KERNEL_MAX_QUERY, Transformer
from serving.engine.parallel.group import TensorParallelGroup, start_workers
from serving.engine.request import Request
from serving.engine.sampling import compute_logprobs, sample_requests
from serving.engine.scheduler import Scheduler, SchedulerOutput
from serving.engine.spec.draft import DraftModelProposer
from serving.engine.spec.ngram import NgramProposer
from serving.engine.spec.proposer import Proposer
from serving.engine.spec.rollout import RolloutDecision
from serving.engine.spec.speculator import Speculator
from serving.engine.types import (
    EngineStats,
    GenerationRequest,
    RequestOutput,
    RequestRejected,
    SpecStats,
    TokenLogprobs,
)

log = logging.getLogger(__name__)

_CPU_DEFAULT_KV_BYTES = 256 * 2**20
_CUDA_ACTIVATION_RESERVE = 0.10  # of the budget left after weights, kept for activations and the allocator


class LLMEngine:
    def __init__(
        self,
        model: Transformer,
        config: EngineConfig,
        num_blocks: int,
        tokenizer: Any | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.args = model.args
        self.max_model_len = model.max_model_len
        self.device, self.dtype = model.device, model.dtype
        self.block_size = config.kv_block_size
        self.cache = KVCache(self.args.n_layers, num_blocks, self.block_size, self.args.n_kv_heads,
                             self.args.head_dim, self.dtype, self.device)
        self.blocks = BlockManager(num_blocks, self.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        self._seed_source = random.Random(config.seed)
        self.steps_total = 0
        self.step_time_total_s = 0.0
        self.step_failures_total = 0
        self._in_step: list[str] = []  # ids of the requests the current step scheduled
        self.last_step_s = 0.0
        self.recent_step_durations_s: collections.deque[float] = collections.deque(maxlen=512)
        self.speculator = speculator
        # kept for the engine's life: its index ramps are made once, not per step
        self.builder = ForwardBatchBuilder(self.block_size, self.args.n_rep, self.device, self.dtype)
        self.compiled: CompiledForward | None = None  # set by compile_steps(); None: every step runs eagerly
        # CUDA: attention reads the paged cache in place (FlexAttention; its Triton tiles need cache blocks of
        # >= 16 tokens). CPU keeps gather + SDPA, measured 1.4-2.3x faster than FlexAttention on CPU for our
        # group shapes (docs/benchmarks/log.md), and its decode and verify groups may read the cache in place
        # through a C++ kernel instead (choose_attention, model.cpu_decode_attention)
        model.set_paged_attention(self.device.type == "cuda" and self.block_size >= 16)
        if speculator is not None and isinstance(speculator.proposer, DraftModelProposer):  # the draft alike
            speculator.proposer.model.set_paged_attention(model.paged_attention)
        self.tp_group: TensorParallelGroup | None = None  # ranks 1..tp-1 (from_config starts them)
        self.weight_packing: list[PackingDecision] = []  # per model (target, draft): set by pack_weights()
        self.draft_rollout: RolloutDecision | None = None  # set by prepare_draft_rollout() (a draft model only)
        self.decode_attention: list[AttentionDecision] = []  # per model (target, draft): set by choose_attention()
        self.threads: ThreadsDecision | None = None  # set by from_config (model.num_threads)
        self.dtype_reason = "the model was built with it"  # from_config: why model.dtype resolved as it did

    # ---- construction -------------------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        if isinstance(config.num_threads, int):  # before loading: the load's own kernels run on these threads
            torch.set_num_threads(config.num_threads)
        if config.device == "cuda" and not torch.cuda.is_available():
            # Never fall back to CPU when the deployment asked for the GPU: stay not ready and say why.
            raise RuntimeError(f"model.device is cuda but torch {torch.__version__} (CUDA build "
                               f"{torch.version.cuda or 'none'}) finds no CUDA device: check the NVIDIA driver, "
                               "the container toolkit (--gpus all) and the image variant")
        device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device
        )
        args = read_model_args(config.model)
        dtype = resolve_dtype(config.dtype, args, device)
        max_model_len = config.max_model_len or args.max_position_embeddings
        if args.sliding_window:
            max_model_len = min(max_model_len, args.sliding_window)
        tp_group = start_workers(config, args, dtype, device, max_model_len)  # None unless tensor parallel
        try:
            model = load_model(config.model, dtype, device, max_model_len, config.quantization,
                               shard=(0, config.tensor_parallel_size))
            # process-wide, decided once the model is loaded (auto measures it) and before every measured choice
            share = max(usable_cores() // config.tensor_parallel_size, 1) if tp_group is not None else None
            threads = choose_threads(model, config.num_threads, cores=share)
            # per device: a tensor-parallel rank holds its share of the KV heads
            per_block = kv_bytes_per_block(args.n_layers, model.args.n_kv_heads, args.head_dim,
                                           config.kv_block_size, dtype)
            num_blocks = max(kv_budget_bytes(config, device) // per_block, 1)
            log.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, config.kv_block_size,
                     num_blocks * per_block / 2**20)
            if tp_group is not None:
                tp_group.ready(model, num_blocks)
            speculator = None
            if config.speculative.enabled:  # the draft runs on rank 0 only, unsharded
                speculator = build_speculator(config, model, dtype, device, num_blocks)
            engine = cls(model, config, num_blocks, load_tokenizer(config.tokenizer or config.model), speculator)
        except BaseException:
            if tp_group is not None:
                tp_group.shutdown()
            raise
        engine.tp_group = tp_group
        engine.dtype_reason = dtype_reason(config.dtype, args, device)
        engine.threads = threads
        # CPU with a draft: the rollout first (compiled and measured on the plain weights it needs), then packing
        engine.prepare_draft_rollout()  # serving.engine.spec.rollout
        engine.pack_weights()  # CPU: measured per model at start-up, before ready (serving.engine.kernels.cpu_linear)
        engine.choose_attention()  # CPU: decode attention in place or gathered (serving.engine.kernels.cpu_attention)
        if compiles(config.compile, device) and tp_group is None:
            engine.compile_steps()  # part of start-up: the server reports ready only after it
        log.info("start-up decisions: %s",
                 "; ".join(f"{key} {value} ({why})" for key, value, why in engine.decisions()))
        return engine

    def decisions(self) -> list[tuple[str, str, str]]:
        """Every choice the engine took by itself at start-up, as (setting, what was chosen, why): the one log
        line at start-up, and what the benchmarks print beside their figures."""
        config = self.config
        rows = [("model.dtype", str(self.dtype).removeprefix("torch."), self.dtype_reason)]
        if self.threads is not None:
            rows.append(("model.num_threads", str(self.threads.threads or torch.get_num_threads()),
                         self.threads.reason))
        rows.append(("model.compile", "on" if self.compiled is not None else "off",
                     f"model.compile is {config.compile} on {self.device.type}"))
        rows += [(f"model.cpu_weight_packing[{d.model}]", "packed" if d.packed else "dense", d.reason)
                 for d in self.weight_packing]
        rows += [(f"model.cpu_decode_attention[{d.model}]", "kernel" if d.kernel else "gather + SDPA", d.reason)
                 for d in self.decode_attention]
        if self.speculator is not None:
            spec = config.speculative
            rows.append(("speculative", f"{spec.method}, k <= {spec.num_draft_tokens}",
                         "adaptive: k per step from measured costs" if spec.adaptive else "k at every step"))
            proposer = self.speculator.proposer
            if isinstance(proposer, DraftModelProposer):
                rows.append(("speculative.draft_token_map", proposer.token_map or "none", proposer.token_map_reason))
            if self.draft_rollout is not None:
                rows.append(("speculative.draft_rollout", "on" if self.draft_rollout.enabled else "off",
                             self.draft_rollout.reason))
        return rows

    def compile_steps(self, measure: bool | None = None, whole_decode: bool | None = None,
                      backend: str = "inductor") -> None:
        """Compile (on CUDA: and capture) the forward of every small-step bucket, before any request.

        measure (default: on CPU only): time each bucket eager and compiled, keep the compiled graph only
        where it is faster. whole_decode (default: with paged attention, i.e. on CUDA): also capture decode
        steps whole, attention included (serving.engine.compile). backend: torch.compile's ("eager" in tests)."""
        if any(d.packed for d in self.weight_packing):
            raise ValueError("compile_steps needs plain nn.Linear weights, but this engine's are packed for oneDNN "
                             "(model.cpu_weight_packing); build the engine with cpu_weight_packing off to compile")
        num_drafts = self.config.speculative.num_draft_tokens if self.config.speculative.enabled else 0
        largest = min(self.config.max_num_seqs * (1 + num_drafts), self.config.max_num_batched_tokens)
        measure = self.device.type == "cpu" if measure is None else measure
        self.compiled = CompiledForward(self.model, buckets_up_to(largest), whole_decode=whole_decode,
                                        max_decode_rows=self.config.max_num_seqs, backend=backend)
        self.compiled.warm_up(self.cache, self.builder, measure)
        proposer = self.speculator.proposer if self.speculator is not None else None
        if isinstance(proposer, DraftModelProposer):  # the draft's steps: one token per sequence
            proposer.compile_steps(self.config.max_num_seqs, measure, whole_decode, backend)

    def pack_weights(self) -> None:
        """model.cpu_weight_packing: pack the target's and the draft's matmul weights for oneDNN, or not."""
        config = self.config
        reason_not = unsupported_reason(self.device, self.dtype, config.quantization,
                                        compiles(config.compile, self.device), self.tp_group is not None)
        self.weight_packing = [choose(self.model, "target", config.cpu_weight_packing, reason_not)]
        proposer = self.speculator.proposer if self.speculator is not None else None
        if isinstance(proposer, DraftModelProposer):
            if proposer.rollout is not None:  # its compiled graph needs plain weights, and pays far more
                self.weight_packing.append(PackingDecision(
                    "draft", False, "the draft drafts through its compiled rollout (speculative.draft_rollout), "
                    "which needs plain weights"))
            else:
                self.weight_packing.append(choose(proposer.model, "draft", config.cpu_weight_packing, reason_not))

    def choose_attention(self) -> None:
        """model.cpu_decode_attention: decode groups of the target and the draft through the CPU kernel, or not."""
        config = self.config
        models = [("target", self.model, self.builder)]
        proposer = self.speculator.proposer if self.speculator is not None else None
        if isinstance(proposer, DraftModelProposer):
            models.append(("draft", proposer.model, proposer.builder))
        self.decode_attention = []
        for name, model, builder in models:
            decision = choose_attention(model, name, config.cpu_decode_attention,
                                        attention_unsupported(model.device, model.dtype, self.tp_group is not None))
            # groups the kernel reads in place need not be split to keep a gathered copy in the CPU's caches
            builder.in_place_max_q = KERNEL_MAX_QUERY if decision.kernel else 0
            self.decode_attention.append(decision)

    def prepare_draft_rollout(self) -> None:
        """speculative.draft_rollout: the draft's catch-up and drafts as one compiled graph, or why not."""
        proposer = self.speculator.proposer if self.speculator is not None else None
        if isinstance(proposer, DraftModelProposer):
            spec = self.config.speculative
            self.draft_rollout = proposer.prepare_rollout(spec.draft_rollout, spec.num_draft_tokens,
                                                          spec.draft_rollout_wrapper)

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any (the engine runs no step after this)."""
        if self.tp_group is not None:
            self.tp_group.shutdown()

    def check_alive(self) -> None:
        """Raise (EngineDeadError) if a tensor-parallel rank has died; the step loop calls it while idle too."""
        if self.tp_group is not None:
            self.tp_group.check_alive()

    # ---- requests -----------------------------------------------------------------------------------

    def check_admission(self, request: GenerationRequest, queued_elsewhere: int = 0) -> None:
        """Raise RequestRejected if the request is invalid, can never fit, or cannot be queued now.

        The one admission check: every limit of the engine is tested here, once per request.
        queued_elsewhere: requests admitted but not yet in the scheduler's queue (the async wrapper's)."""
        params, n_prompt = request.params, len(request.prompt_token_ids)
        # The one context-length check (the server's errors are this one's). A prompt that fills the context leaves
        # no room for a token to generate, unless the request only scores it.
        total = n_prompt + params.max_tokens
        scoring_only = params.max_tokens == 0 and params.prompt_logprobs is not None
        no_room = n_prompt >= self.max_model_len and params.max_tokens < 1 and not scoring_only
        if total > self.max_model_len or no_room:
            raise RequestRejected(
                "never_fits",
                f"prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the context length "
                f"{self.max_model_len}", param="max_tokens",
            )
        try:
            params.validate()
        except ValueError as exc:
            raise RequestRejected("invalid", str(exc)) from exc
        if n_prompt == 0:
            raise RequestRejected("invalid", "prompt is empty")
        if any(not 0 <= t < self.args.vocab_size for t in request.prompt_token_ids):
            raise RequestRejected("invalid", f"prompt has token ids outside [0, {self.args.vocab_size})")
        if any(not 0 <= t < self.args.vocab_size for t in request.params.logit_bias):
            raise RequestRejected("invalid", f"logit_bias has token ids outside [0, {self.args.vocab_size})")
        if request.params.stop and self.tokenizer is None:
            raise RequestRejected("invalid", "stop strings need a tokenizer; this model has none")
        lookahead = self.config.speculative.num_draft_tokens if self.config.speculative.enabled else 0
        needed = self.blocks.blocks_for(total + lookahead)
        if needed > self.blocks.num_blocks:
            raise RequestRejected(
                "never_fits",
                f"prompt + max_tokens = {total} tokens needs {needed} KV blocks of {self.block_size}; "
                f"the cache has {self.blocks.num_blocks} in all",
            )
        queued = len(self.scheduler.waiting) + queued_elsewhere
        if queued >= self.config.max_queue:
            raise RequestRejected("queue_full", f"{queued} requests already queued")

    def add_request(self, request: GenerationRequest) -> None:
        self.check_admission(request)
        self.enqueue(request)

    def enqueue(self, request: GenerationRequest) -> None:
        """Queue a request that check_admission accepted (add_request checks it first)."""
        self.scheduler.add_request(Request(
            request.request_id,
            request.prompt_token_ids,
            request.params,
            eos_token_ids=self.args.eos_token_ids,
            max_model_len=self.max_model_len,
            tokenizer=self.tokenizer,
            default_seed=self._seed_source.getrandbits(63),
            grammar=request.grammar,
        ))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End the request now and free its blocks; returns its final chunk if it was live."""
        req = self.scheduler.finish_request(request_id, "abort")
        if self.speculator is not None:
            self.speculator.release(request_id)
        return req.make_output() if req is not None else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        self._in_step = [r.request_id for r in self.scheduler.running]
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        self._in_step = [r.request_id for r in sched.scheduled]
        sampled, logprobs = self.execute(sched)
        updated = self.scheduler.update_from_output(sched, sampled, logprobs)
        outputs = [o for o in (req.make_output() for req in updated) if o is not None]
        if self.speculator is not None:
            self.speculator.after_update(sched, sampled, time.perf_counter() - started)
            self.speculator.propose_next(self.scheduler)
        self._record_step(time.perf_counter() - started)
        return outputs

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]]]:
        """Run the step's forward; sample (or verify drafts) for every request that reaches its end."""
        seqs, sampling, drafts = [], [], []
        starts = [0]  # sampling request i owns logits rows [starts[i], starts[i + 1]): last real token, drafts
        prompt_rows: list[tuple[Request, int, int]] = []  # (request, first position, count) of prompt logprobs
        for req in sched.scheduled:
            n = sched.num_scheduled_tokens[req.request_id]
            start = req.num_computed_tokens
            spec = sched.spec_token_ids.get(req.request_id, [])
            samples = sched.samples(req)
            # prompt logprobs: the logits at prompt position p score prompt token p + 1
            scored = max(min(start + n, req.num_prompt_tokens - 1) - start, 0) if req.wants_prompt_logprobs else 0
            seqs.append(SequenceInput(
                token_ids=(req.all_token_ids[start:] + spec)[:n] if spec else req.all_token_ids[start : start + n],
                start_pos=start,
                block_table=self.blocks.block_table(req.request_id),
                # a verifying sequence needs logits at its last real token and at every draft
                logits_offsets=list(range(scored)) + (list(range(n - 1 - len(spec), n)) if samples else []),
            ))
            if scored:
                prompt_rows.append((req, start, scored))
            if samples:
                sampling.append(req)
                drafts.append(spec)
                starts.append(starts[-1] + len(spec) + 1)
        batch = self.builder.build(seqs)
        if self.tp_group is not None:
            self.tp_group.send_step(seqs)  # the other ranks run this forward with rank 0
        hidden = self.run_forward(batch)
        if not sampling and not prompt_rows:
            return {}, {}
        logits = self.model.compute_logits(hidden, batch.logits_index)  # [rows, vocab] fp32, request order
        if prompt_rows:
            logits = self.record_prompt_logprobs(sched, prompt_rows, logits)
        if not sampling:
            return {}, {}
        emitted = self.sample_or_verify(sampling, drafts, logits, starts)
        sampled = {r.request_id: tokens for r, tokens in zip(sampling, emitted, strict=True)}
        return sampled, self.logprobs_of(sampling, emitted, logits, starts)

    def run_forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, dim]: through the step's compiled bucket when there is one, else eagerly."""
        if self.compiled is not None:
            return self.compiled(batch, self.cache)
        return self.model(batch, self.cache)

    def sample_or_verify(
        self, reqs: list[Request], drafts: list[list[int]], logits: torch.Tensor, starts: list[int]
    ) -> list[list[int]]:
        """One token per plain request; accepted drafts plus one token per verifying request.

        starts: request i's rows are logits[starts[i] : starts[i + 1]] (one, or 1 + its drafts)."""
        if any(r.grammar is not None for r in reqs):  # a masked copy: logprobs stay those of the raw logits
            row_grammars: list[RequestGrammar | None] = [None] * logits.shape[0]
            for r, d, start in zip(reqs, drafts, starts, strict=False):
                row_grammars[start] = None if d else r.grammar  # verify rows are masked by the speculator
            logits = apply_grammar_masks(logits, row_grammars)
        if not any(drafts):
            tokens = sample_requests(logits, [r.params for r in reqs], [r.noise_key() for r in reqs],
                                     [r.output_token_ids for r in reqs])
            return [[t] for t in tokens.tolist()]
        assert self.speculator is not None
        plain = [i for i, d in enumerate(drafts) if not d]
        verifying = [i for i, d in enumerate(drafts) if d]
        emitted: list[list[int]] = [[] for _ in reqs]
        if plain:
            idx = torch.tensor([starts[i] for i in plain], device=logits.device)
            sampled = sample_requests(logits[idx], [reqs[i].params for i in plain],
                                      [reqs[i].noise_key() for i in plain], [reqs[i].output_token_ids for i in plain])
            for i, t in zip(plain, sampled.tolist(), strict=True):
                emitted[i] = [t]
        rows = [range(starts[i], starts[i + 1]) for i in verifying]
        verified = self.speculator.verify([reqs[i] for i in verifying], [drafts[i] for i in verifying], logits, rows)
        for i, accepted in zip(verifying, verified, strict=True):
            emitted[i] = accepted
        return emitted

    def record_prompt_logprobs(
        self, sched: SchedulerOutput, prompt_rows: list[tuple[Request, int, int]], logits: torch.Tensor
    ) -> torch.Tensor:
        """Hand each request the logprobs of the prompt tokens this step scored; returns the sampling rows.

        The logits rows are in request order; a request's prompt rows come before its sampling rows."""
        scored = {id(req): count for req, _, count in prompt_rows}
        keep: list[int] = []  # the sampling rows
        prompt_index: list[int] = []
        tokens: list[int] = []
        top_n: list[int] = []
        row = 0
        for req in sched.scheduled:
            count = scored.get(id(req), 0)
            prompt_index.extend(range(row, row + count))
            row += count
            if sched.samples(req):
                width = len(sched.spec_token_ids.get(req.request_id, [])) + 1
                keep.extend(range(row, row + width))
                row += width
        for req, start, count in prompt_rows:
            tokens.extend(req.prompt_token_ids[start + 1 : start + 1 + count])
            top_n.extend([req.params.prompt_logprobs or 0] * count)
        index = torch.tensor(prompt_index, device=logits.device)
        computed = iter(compute_logprobs(logits[index], torch.tensor(tokens, device=logits.device), top_n))
        for req, start, count in prompt_rows:
            req.add_prompt_logprobs(start + 1, [next(computed) for _ in range(count)])
        return logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]

    def logprobs_of(
        self, reqs: list[Request], emitted: list[list[int]], logits: torch.Tensor, starts: list[int]
    ) -> dict[str, list[TokenLogprobs]]:
        wants = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if not wants:
            return {}
        rows = [starts[i] + j for i in wants for j in range(len(emitted[i]))]
        tokens = torch.tensor([t for i in wants for t in emitted[i]], device=logits.device)
        top_n = [reqs[i].params.logprobs or 0 for i in wants for _ in emitted[i]]
        computed = iter(compute_logprobs(logits[torch.tensor(rows, device=logits.device)], tokens, top_n))
        return {reqs[i].request_id: [next(computed) for _ in emitted[i]] for i in wants}

    def recover_from_failed_step(self) -> list[str]:
        """After `step` raised: end every request the step touched or that holds KV blocks, free their
        blocks and draft state, and return their ids (the caller fails their streams).

        Queued requests stay queued. Cached prefix blocks stay valid: a block is content-addressed only
        in `update_from_output`, after its forward completed. Raises if the block accounting does not
        come back to zero held blocks, where the engine cannot be trusted any more."""
        failed = list(dict.fromkeys([*self._in_step, *(r.request_id for r in self.scheduler.running)]))
        for request_id in failed:
            self.abort_request(request_id)
            self.blocks.free(request_id)  # also a request the step finished before it raised
        self._in_step = []
        self.step_failures_total += 1
        holders = [r.request_id for r in self.scheduler.running]
        if holders or self.blocks.num_used:
            raise RuntimeError(f"engine state inconsistent after a failed step: {self.blocks.num_used} KV blocks "
                               f"still held, running {holders[:5]}")
        return failed

    def _record_step(self, seconds: float) -> None:
        self.steps_total += 1
        self.step_time_total_s += seconds
        self.last_step_s = seconds
        self.recent_step_durations_s.append(seconds)

    # ---- counters -----------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        c = self.scheduler.counters
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            kv_blocks_used=self.blocks.num_used,
            kv_blocks_total=self.blocks.num_blocks,
            kv_block_size=self.block_size,
            prompt_tokens_total=c.prompt_tokens_total,
            generation_tokens_total=c.generation_tokens_total,
            preemptions_total=c.preemptions_total,
            requests_finished_total=c.requests_finished_total,
            prefix_cache_queries_total=c.prefix_cache_queries_total,
            prefix_cache_hits_total=c.prefix_cache_hits_total,
            step_failures_total=self.step_failures_total,
            steps_total=self.steps_total,
            step_time_total_s=self.step_time_total_s,
            last_step_s=self.last_step_s,
            recent_step_durations_s=list(self.recent_step_durations_s),
            spec=copy.deepcopy(self.speculator.stats) if self.speculator is not None else SpecStats(),
        )


def build_speculator(
    config: EngineConfig, model: Transformer, dtype: torch.dtype, device: torch.device, num_blocks: int
) -> Speculator:
    spec = config.speculative
    proposer: Proposer
    if spec.method == "ngram":
        proposer = NgramProposer(spec.ngram_min, spec.ngram_max)
    else:
        assert spec.draft_model is not None
        # as many draft blocks as target blocks: the draft never runs out before the target does
        proposer = DraftModelProposer.load(spec.draft_model, config.model, model.args, dtype, device,
                                           model.max_model_len, num_blocks, config.kv_block_size,
                                           spec.draft_token_map)
    return Speculator(spec, proposer, model.max_model_len)


def compiles(mode: str, device: torch.device) -> bool:
    """model.compile: auto compiles on CUDA only (on CPU the start-up cost outweighs the gain, measured)."""
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def kv_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    """Bytes for the KV cache: explicit on CPU; on CUDA max_memory_utilization of the device minus what is in use."""
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    if device.type != "cuda":
        return _CPU_DEFAULT_KV_BYTES
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free  # weights (already loaded) plus anything else on the device
    budget = config.max_memory_utilization * total - in_use
    if budget <= 0:
        raise RuntimeError(
            f"no memory left for the KV cache: {in_use / 2**30:.1f} GiB in use of "
            f"{config.max_memory_utilization:.2f} x {total / 2**30:.1f} GiB"
        )
    return int(budget * (1 - _CUDA_ACTIVATION_RESERVE))


def load_tokenizer(path: str | Path) -> Any | None:
    """The model's tokenizer if its directory has one (tests run tokenizer-less tiny models)."""
    directory = Path(path)
    if not (directory / "tokenizer.json").is_file() and not (directory / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))
