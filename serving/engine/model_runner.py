"""The model runner: the target model, its KV cache tensors, and one step's forward → sample or verify → logprobs.

The engine core (serving.engine.engine) hands it each SchedulerOutput; it builds the step's forward batch,
runs it (through a compiled bucket when there is one, on every tensor-parallel rank), samples one token per
plain request, verifies each speculating request's drafts, and extracts the logprobs requests asked for.
"""

from __future__ import annotations

import torch

from serving.engine.batch import ForwardBatch, ForwardBatchBuilder, SequenceInput
from serving.engine.compile import CompiledForward, buckets_up_to
from serving.engine.config import EngineConfig
from serving.engine.grammar import RequestGrammar, apply_grammar_masks
from serving.engine.kernels.cpu_attention import AttentionDecision
from serving.engine.kernels.cpu_linear import PackingDecision
from serving.engine.kv_cache import BlockManager, KVCache
from serving.engine.model import Transformer
from serving.engine.parallel.group import TensorParallelGroup
from serving.engine.request import Request
from serving.engine.sampling import compute_logprobs, sample_requests
from serving.engine.scheduler import SchedulerOutput
from serving.engine.spec.rollout import RolloutDecision
from serving.engine.spec.speculator import Speculator
from serving.engine.types import TokenLogprobs


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        config: EngineConfig,
        num_blocks: int,
        speculator: Speculator | None = None,
        tp_group: TensorParallelGroup | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.device, self.dtype = model.device, model.dtype
        args = model.args
        self.cache = KVCache(args.n_layers, num_blocks, config.kv_block_size, args.n_kv_heads, args.head_dim,
                             self.dtype, self.device)
        # verifies the drafts of speculating requests; the engine core asks it for proposals between steps
        self.speculator = speculator
        self.tp_group = tp_group  # ranks 1..tp-1, which run every forward with this one
        # kept for the engine's life: its index ramps are made once, not per step
        self.builder = ForwardBatchBuilder(config.kv_block_size, args.n_rep, self.device, self.dtype)
        self.compiled: CompiledForward | None = None  # set by compile_steps(); None: every step runs eagerly
        # CUDA: attention reads the paged cache in place (FlexAttention; its Triton tiles need cache blocks of
        # >= 16 tokens). CPU keeps gather + SDPA, measured 1.4-2.3x faster than FlexAttention on CPU for our
        # group shapes (docs/benchmarks/log.md), and its decode and verify groups may read the cache in place
        # through a C++ kernel instead (serving.engine.kernels.cpu_attention, model.cpu_decode_attention)
        model.set_paged_attention(self.device.type == "cuda" and config.kv_block_size >= 16)
        if speculator is not None:  # the draft alike
            speculator.proposer.set_paged_attention(model.paged_attention)
        # what serving.engine.build.tune decided for the models this runner runs (the benchmarks report them)
        self.weight_packing: list[PackingDecision] = []  # per model: target, draft
        self.decode_attention: list[AttentionDecision] = []  # per model: target, draft
        self.draft_rollout: RolloutDecision | None = None  # a draft model's rollout
        self.primitive_caches: tuple[str, str] = ("unbounded", "not set by the build")  # kernels/primitive_cache.py

    def compile_steps(self, measure: bool | None = None, whole_decode: bool | None = None,
                      backend: str = "inductor") -> None:
        """Compile (on CUDA: and capture) the forward of every small-step bucket, before any request.

        measure (default: on CPU only): time each bucket eager and compiled, keep the compiled graph only
        where it is faster. whole_decode (default: with paged attention, i.e. on CUDA): also capture decode
        steps whole, attention included (serving.engine.compile). backend: torch.compile's ("eager" in tests)."""
        if any(d.packed for d in self.weight_packing):
            raise ValueError("compile_steps needs plain nn.Linear weights, but this engine's are packed for oneDNN "
                             "(model.cpu_weight_packing); build the engine with cpu_weight_packing off to compile")
        config = self.config
        num_drafts = config.speculative.num_draft_tokens if config.speculative.enabled else 0
        largest = min(config.max_concurrency * (1 + num_drafts), config.max_batched_tokens)
        measure = self.device.type == "cpu" if measure is None else measure
        self.compiled = CompiledForward(self.model, buckets_up_to(largest), whole_decode=whole_decode,
                                        max_decode_rows=config.max_concurrency, backend=backend)
        self.compiled.warm_up(self.cache, self.builder, measure)
        if self.speculator is not None:  # the draft's steps: one token per sequence
            self.speculator.proposer.compile_steps(config.max_concurrency, measure, whole_decode, backend)

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any (no step runs after this)."""
        if self.tp_group is not None:
            self.tp_group.shutdown()

    def check_alive(self) -> None:
        """Raise (EngineDeadError) if a tensor-parallel rank has died."""
        if self.tp_group is not None:
            self.tp_group.check_alive()

    # ---- the step -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(
        self, sched: SchedulerOutput, blocks: BlockManager
    ) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]]]:
        """Run the step's forward; sample (or verify drafts) for every request that reaches its end.

        blocks: the block tables of the scheduled requests (the scheduler's BlockManager)."""
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
                block_table=blocks.block_table(req.request_id),
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
