"""Draft-model proposer: a small Llama-family model with its own paged KV cache proposes k tokens per step.

Per sequence the draft cache holds a prefix of the sequence's tokens. Each engine step the draft first
catches up (the tokens accepted or emitted since last time, at most a few; the whole prompt the first
time) and drafts one token from that forward, then runs k - 1 batched single-token steps. Rejected
drafts are rolled back by shortening the sequence in the draft cache; nothing is copied.

The draft cache caches prefixes the way the target's does (kv_cache.BlockManager, same block hashes): a
sequence the draft has not seen starts on the draft's cached blocks of its longest cached prefix, so the
first catch-up of a request that shares a system prompt with an earlier one computes only the rest. Only
blocks full of the sequence's own tokens get a content address, never ones holding draft tokens.

With `speculative.draft_rollout` (CPU), a step where a single greedy sequence drafts, its draft lagging by
at most two tokens, runs the catch-up and all the drafts as one compiled graph instead
(serving.engine.spec.rollout), where that is expected to cost less than the forwards it replaces.

The draft reads at most `speculative.draft_context` tokens of a sequence (auto: the context it was trained on,
its max_position_embeddings, where that is shorter than the target's). Its view of a sequence is the tokens from
an offset on, at positions counted from the offset: 0 until the view with a step's drafts would pass the
context, then the start of the sequence's latest half-context of tokens, which the draft reads anew (one
catch-up forward) and continues from. A draft past the length it was trained on proposes what the target
rejects: the demo draft, trained on 256-token windows, went from 4.7 to 6.6 tokens a round on held-out prompts
of 290-300 tokens with its reading held to their last 128 (docs/benchmarks/log.md). Proposals change, never
the output: verification decides every token.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from serving.config import MAX_DRAFT_TOKENS, MIN_DRAFT_CONTEXT, DecodeAttentionMode, WeightPacking
from serving.engine.batch import ForwardBatch, ForwardBatchBuilder, SequenceInput
from serving.engine.compile import CompiledForward, buckets_up_to
from serving.engine.grammar import apply_grammar_masks
from serving.engine.kernels import cpu_attention, cpu_linear
from serving.engine.kernels.cpu_attention import AttentionDecision
from serving.engine.kernels.cpu_linear import PackingDecision
from serving.engine.kv_cache import BlockManager, KVCache
from serving.engine.loader import load_model, read_model_args
from serving.engine.logits import adjust_logits
from serving.engine.model import ModelArgs, Transformer
from serving.engine.request import Request
from serving.engine.sampling import SamplingRows, greedy_tokens, logits_to_probs, position_noise, race
from serving.engine.spec.proposer import Proposals
from serving.engine.spec.rollout import MAX_LAG, DraftRollout, RolloutDecision, prepare
from serving.engine.spec.token_map import apply_token_map, read_token_map, resolve, token_map_path

log = logging.getLogger(__name__)


class DraftMismatchError(ValueError):
    """The draft cannot serve this target (different tokenizer or vocabulary)."""


def check_same_tokenizer(target_dir: Path, draft_dir: Path, target: ModelArgs, draft: ModelArgs) -> None:
    if target.vocab_size != draft.vocab_size:
        raise DraftMismatchError(
            f"draft {draft_dir} has vocab_size {draft.vocab_size}, the target {target_dir} {target.vocab_size}: "
            "a draft must share the target's tokenizer"
        )
    t_file, d_file = target_dir / "tokenizer.json", draft_dir / "tokenizer.json"
    if t_file.is_file() and d_file.is_file():
        t_vocab = json.loads(t_file.read_text()).get("model", {}).get("vocab")
        d_vocab = json.loads(d_file.read_text()).get("model", {}).get("vocab")
        if t_vocab != d_vocab:
            raise DraftMismatchError(f"draft {draft_dir} and target {target_dir} have different tokenizers")


def resolve_context(setting: int | str | None, draft: ModelArgs, max_model_len: int) -> tuple[int | None, str]:
    """speculative.draft_context: the most tokens of a sequence the draft reads (None: all of them), and why."""
    if setting is None:
        return None, "speculative.draft_context is none"
    if setting != "auto":  # a length the config has checked (SpeculativeSection refuses one under MIN_DRAFT_CONTEXT)
        if int(setting) >= max_model_len:
            return None, f"speculative.draft_context {setting} covers the context ({max_model_len} tokens)"
        return int(setting), "speculative.draft_context names it"
    trained = draft.max_position_embeddings
    if trained >= max_model_len:
        return None, f"auto: the draft's max_position_embeddings ({trained}) covers the context ({max_model_len})"
    if trained < MIN_DRAFT_CONTEXT:
        return None, (f"auto: the draft's max_position_embeddings ({trained}) is under {MIN_DRAFT_CONTEXT}, too short "
                      "to restart on half of it; the draft reads whole sequences")
    return trained, (f"auto: the draft's max_position_embeddings, under the context ({max_model_len}); past it the "
                     f"draft reads the latest {trained // 2} tokens anew")


class DraftModelProposer:
    uses_model = True  # every draft position is a forward of the draft model

    def __init__(self, model: Transformer, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        self.model = model
        args = model.args
        self.device = model.tok_embeddings.weight.device
        self.dtype = model.tok_embeddings.weight.dtype
        self.block_size = block_size
        self.cache = KVCache(args.n_layers, num_blocks, block_size, args.n_kv_heads, args.head_dim, self.dtype,
                             self.device)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.builder = ForwardBatchBuilder(block_size, args.n_rep, self.device, self.dtype)
        self.compiled: CompiledForward | None = None  # compile_steps(): the draft's small steps as graphs
        self.rollout: DraftRollout | None = None  # prepare_rollout(): catch-up and drafts as one graph
        self.rollout_decision: RolloutDecision | None = None  # prepare_rollout(): whether it rolls out, and why
        self.rollouts_total = 0  # compiled rollouts run
        self.computed: dict[str, int] = {}  # req_id -> tokens of the sequence in the draft cache
        self.catch_up_tokens_total = 0  # sequence tokens the draft computed (prompts, accepted and emitted tokens)
        self.prefix_hit_tokens_total = 0  # sequence tokens found in the draft's prefix cache instead
        self.token_map_size: int | None = None  # load(token_map=...): the tokens the draft may propose
        self.token_map: str | None = None  # the file it came from
        self.token_map_reason = "the full vocabulary"  # why (speculative.draft_token_map, resolved)
        self.context: int | None = None  # speculative.draft_context, resolved (None: whole sequences)
        self.context_reason = "the whole sequence"
        self.offset: dict[str, int] = {}  # req_id -> the first sequence position the draft reads
        self.context_restarts_total = 0  # views moved on to a sequence's latest half-context

    @classmethod
    def load(
        cls,
        draft_dir: str | Path,
        target_dir: str | Path,
        target_args: ModelArgs,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        num_blocks: int,
        block_size: int,
        token_map: str | None = None,
        context: int | str | None = "auto",
    ) -> DraftModelProposer:
        """The draft model, checked against the target's tokenizer; with token_map (speculative.draft_token_map: a
        file in draft_dir, or auto, serving.engine.spec.token_map.resolve) its lm_head restricted to the map's
        tokens (serving.engine.spec.token_map)."""
        draft_dir, target_dir = Path(draft_dir), Path(target_dir)
        draft_args = read_model_args(draft_dir)
        check_same_tokenizer(target_dir, draft_dir, target_args, draft_args)
        token_map, reason = resolve(draft_dir, token_map)
        # a bad map is refused before the weights are read
        ids = read_token_map(token_map_path(draft_dir, token_map), draft_args.vocab_size) if token_map else None
        model = load_model(draft_dir, dtype, device, max_model_len)
        proposer = cls(model, num_blocks, block_size)
        proposer.token_map_reason = reason
        proposer.context, proposer.context_reason = resolve_context(context, draft_args, max_model_len)
        if token_map is not None and ids is not None:
            apply_token_map(model, ids)
            proposer.token_map_size = len(ids)
            proposer.token_map = token_map
            log.info("draft token map %s: the draft proposes %d of %d tokens", token_map, len(ids),
                     model.args.vocab_size)
        return proposer

    # ---- start-up (the Proposer protocol's hooks, called by serving.engine.build) --------------------------

    def set_paged_attention(self, on: bool) -> None:
        self.model.set_paged_attention(on)

    def compile_steps(self, max_rows: int, measure: bool, whole_decode: bool | None = None,
                      backend: str = "inductor") -> None:
        """Compile (on CUDA: capture) the draft's steps of up to max_rows tokens, as the target's are: a draft
        step is one token per sequence, so small and launch-bound; on CUDA an eager draft step would cost
        about as much as the target's captured one. Runs at start-up, before any request."""
        self.compiled = CompiledForward(self.model, buckets_up_to(max_rows), whole_decode=whole_decode,
                                        max_decode_rows=max_rows, backend=backend)
        self.compiled.warm_up(self.cache, self.builder, measure)

    def prepare_rollout(self, mode: str, num_draft_tokens: int, wrapper: str = "cpp") -> RolloutDecision:
        """speculative.draft_rollout: compile (and in auto, measure) the rollout at start-up, before any request."""
        rollout, decision = prepare(self.model, mode, num_draft_tokens, wrapper)  # type: ignore[arg-type]
        self.rollout, self.rollout_decision = rollout, decision
        return decision

    def pack_weights(self, mode: WeightPacking, reason_not: str | None) -> list[PackingDecision]:
        """model.cpu_weight_packing for the draft (after prepare_rollout: a rollout keeps the weights plain)."""
        if self.rollout is not None:  # its compiled graph needs plain weights, and pays far more
            return [PackingDecision("draft", False, "the draft drafts through its compiled rollout "
                                    "(speculative.draft_rollout), which needs plain weights")]
        return [cpu_linear.choose(self.model, "draft", mode, reason_not)]

    def choose_attention(self, mode: DecodeAttentionMode, tensor_parallel: bool) -> list[AttentionDecision]:
        return [cpu_attention.choose_for(self.model, "draft", self.builder, mode, tensor_parallel)]

    def decisions(self) -> list[tuple[str, str, str]]:
        rows = [("speculative.draft_token_map", self.token_map or "none", self.token_map_reason),
                ("speculative.draft_context", str(self.context) if self.context else "whole sequence",
                 self.context_reason)]
        if self.rollout_decision is not None:
            rows.append(("speculative.draft_rollout", "on" if self.rollout_decision.enabled else "off",
                         self.rollout_decision.reason))
        return rows

    # ---- drafting ------------------------------------------------------------------------------------------

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.compiled is not None:
            return self.compiled(batch, self.cache)
        return self.model(batch, self.cache)

    def lag(self, req: Request) -> int:
        """Tokens the draft must run for this sequence before it can draft (1 when it is up to date)."""
        n = self._view_len(req)
        return n - min(self._start(req), n - 1)

    def _view_len(self, req: Request) -> int:
        """Tokens of the sequence the draft reads: from its offset on (_start places the view first)."""
        self._start(req)
        return req.num_tokens - self.offset.get(req.request_id, 0)

    def _view(self, req: Request) -> list[int]:
        """The tokens the draft reads (read only: the request's own list where the view starts at 0, no copy)."""
        offset = self.offset.get(req.request_id, 0)
        return req.all_token_ids[offset:] if offset else req.all_token_ids

    def _start(self, req: Request) -> int:
        """Tokens of the sequence's view in the draft cache. A sequence seen for the first time takes its cached
        prefix; one whose view would pass the draft's context with a step's drafts starts a new view on its
        latest half-context of tokens."""
        rid = req.request_id
        computed = self.computed.get(rid)
        if computed is not None and (self.context is None or
                                     req.num_tokens - self.offset.get(rid, 0) + self._reach() <= self.context):
            return computed
        if computed is not None:  # the view moves on: its cached tokens are at positions of the old one
            self.blocks.free(rid)
            self.context_restarts_total += 1
        offset = 0
        if self.context is not None and req.num_tokens + self._reach() > self.context:
            offset = req.num_tokens - self.context // 2
        self.offset[rid] = offset
        computed = self.blocks.match_prefix(rid, req.all_token_ids[offset:])
        self.computed[rid] = computed
        self.prefix_hit_tokens_total += computed
        return computed

    def _reach(self) -> int:
        """Positions past the sequence's tokens that one step of drafting may write: a rollout's steps, or the
        most drafts a step (a catch-up token included)."""
        return self.rollout.steps if self.rollout is not None else MAX_DRAFT_TOKENS + 1

    def release(self, req_id: str) -> None:
        self.blocks.free(req_id)
        self.computed.pop(req_id, None)
        self.offset.pop(req_id, None)

    def rollback(self, req_id: str, num_valid_tokens: int) -> None:
        """Keep only the first num_valid_tokens of the sequence (the rest were rejected drafts)."""
        valid = num_valid_tokens - self.offset.get(req_id, 0)  # of the draft's view
        if req_id in self.computed and self.computed[req_id] > valid:
            self.computed[req_id] = valid
            self.blocks.truncate(req_id, valid)

    @torch.inference_mode()
    def propose(self, reqs: list[Request], ks: dict[str, int]) -> Proposals:
        drafts = Proposals()
        active = []
        for req in reqs:
            k = ks.get(req.request_id, 0)
            # positions N .. N + k - 2 of the view get draft K/V (the last draft is never fed back)
            if k > 0 and self.blocks.allocate(req.request_id, self._view_len(req) + k - 1):
                active.append(req)
        if active and not (self._rolls_out_now(active, ks) and self._roll_out(active[0], ks[active[0].request_id],
                                                                              drafts)):
            self._step_by_step(active, ks, drafts)
        return drafts

    def _step_by_step(self, active: list[Request], ks: dict[str, int], drafts: Proposals) -> None:
        """One forward per draft position: the catch-up (drafting the first token), then k - 1 single tokens."""
        walked: dict[str, int] = {}  # grammar requests: drafts their matcher accepted (rolled back at the end)
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in active}  # q rows, for rejection sampling

        # first forward: catch up on the tokens the draft has not seen, draft one token from the last
        seqs = []
        views = {req.request_id: self._view(req) for req in active}  # positions count from each view's start
        for req in active:
            view = views[req.request_id]
            tokens = view[len(view) - self.lag(req) :]
            start = len(view) - len(tokens)
            seqs.append(SequenceInput(tokens, start, self.blocks.block_table(req.request_id), [len(tokens) - 1]))
            self.computed[req.request_id] = len(view)
            self.catch_up_tokens_total += len(tokens)
        self._draft_step(active, seqs, drafts, probs, walked)
        for req in active:  # blocks now full of the sequence's own tokens become reusable by content
            view = views[req.request_id]
            self.blocks.commit(req.request_id, view, len(view))

        for j in range(1, max(ks[r.request_id] for r in active)):
            step = [r for r in active if ks[r.request_id] > j]
            seqs = [SequenceInput([drafts.tokens[r.request_id][-1]], len(views[r.request_id]) + j - 1,
                                  self.blocks.block_table(r.request_id), [0]) for r in step]
            for r in step:
                self.computed[r.request_id] = len(views[r.request_id]) + j
            self._draft_step(step, seqs, drafts, probs, walked)

        for req in active:
            if req.grammar is not None:
                n = walked.get(req.request_id, 0)
                req.grammar.rollback(n if n >= 0 else -n - 1)
        drafts.probs.update({req_id: torch.stack(rows) for req_id, rows in probs.items() if rows})

    def fixed_draft_seconds(self, req: Request) -> float | None:
        """What drafting for this sequence alone costs through the rollout, any k (None: it would not be rolled
        out). The policy weighs k against this fixed cost."""
        if self.rollout is None or not self._rolls_out(req):
            return None
        return self.rollout.rollout_cost(1)

    def _rolls_out(self, r: Request) -> bool:
        """Whether a rollout can draft for this sequence: greedy and plain, its draft lagging by at most MAX_LAG
        tokens, with room for every rollout step in the context."""
        assert self.rollout is not None
        lag, n = self.lag(r), self._view_len(r)
        return (r.params.greedy and r.grammar is None and not r.params.adjusts_logits and lag <= MAX_LAG
                and n - lag >= 1 and n - lag + self.rollout.steps <= self.model.max_model_len)

    def _rolls_out_now(self, active: list[Request], ks: dict[str, int]) -> bool:
        """Whether this step's drafting is one rollout: a single sequence drafts, the rollout can serve it, and
        is expected to cost less than its step-by-step forwards."""
        if self.rollout is None or len(active) != 1 or not self._rolls_out(active[0]):
            return False
        (r,) = active
        return self.rollout.pays([self.lag(r)] + [1] * (ks[r.request_id] - 1))

    def _roll_out(self, r: Request, k: int, drafts: Proposals) -> bool:
        """Catch-up and k drafts of one sequence as one compiled rollout; False (nothing changed) if the graph
        refused the call, after which the rollout is off for good."""
        assert self.rollout is not None
        started = time.perf_counter()
        bs, dev = self.block_size, self.device
        lag, view = self.lag(r), self._view(r)
        ctx = len(view) - lag  # tokens of the sequence's view in the draft cache
        table = self.blocks.block_table(r.request_id)
        blocks = torch.tensor(table[: -(-ctx // bs)], device=dev)
        shape = (self.cache.k.shape[0], 1, len(blocks) * bs, self.cache.n_kv_heads, self.cache.head_dim)
        forced = view[ctx:] + [0] * (self.rollout.steps - lag)  # its unseen tokens, then drafts
        try:  # positions and ctx_len are equal but must be distinct tensors (the graph's guards say so)
            out, k_new, v_new = self.rollout((
                torch.tensor(forced, device=dev)[:, None], torch.tensor([lag], device=dev),
                torch.tensor([ctx], device=dev), self.cache.k.index_select(1, blocks).view(shape),
                self.cache.v.index_select(1, blocks).view(shape), torch.tensor([ctx], device=dev)))
        except Exception as exc:  # a guard the warm-up did not foresee: draft step by step from now on
            log.warning("draft rollout refused a call (%s); the draft proposes step by step from now on", exc)
            self.rollout = None
            return False
        drafts.tokens[r.request_id] = out[lag - 1 : lag - 1 + k, 0].tolist()
        fed = lag + k - 1  # fed tokens kept: up to the last draft but one, as step by step
        slots = [table[p // bs] * bs + p % bs for p in range(ctx, ctx + fed)]
        self.cache.write_layers(torch.tensor(slots, device=dev), k_new[:fed, :, 0].transpose(0, 1),
                                v_new[:fed, :, 0].transpose(0, 1))
        self.computed[r.request_id] = len(view) + k - 1
        self.catch_up_tokens_total += lag
        # blocks now full of the sequence's own tokens become reusable by content
        self.blocks.commit(r.request_id, view, len(view))
        # the policy is given this cost as a whole (fixed_draft_seconds), not as forwards of its draft_cost fit
        drafts.rollout_seconds = time.perf_counter() - started
        self.rollout.rollout_cost.observe(1, drafts.rollout_seconds)
        self.rollouts_total += 1
        return True

    def _draft_step(self, reqs: list[Request], seqs: list[SequenceInput], drafts: Proposals,
                    probs: dict[str, list[torch.Tensor]], walked: dict[str, int]) -> None:
        started = time.perf_counter()
        batch = self.builder.build(seqs)
        logits = self.model.compute_logits(self.forward(batch), batch.logits_index)  # [n, V]
        grammars = [r.grammar if walked.get(r.request_id, 0) >= 0 else None for r in reqs]
        if any(g is not None for g in grammars):
            # the draft follows the grammar too (its q is the masked distribution, so verification stays lossless),
            # or most of what it proposes would be cut (grammar.admissible_drafts)
            logits = apply_grammar_masks(logits, grammars)
        # penalties and logit bias as the target's verify rows get them (lossless either way: q is what the
        # drafts are sampled from), so a draft close to the target stays close under them and is accepted
        if any(r.params.adjusts_logits for r in reqs):
            logits = adjust_logits(logits, [r.params for r in reqs],
                                   [r.output_token_ids + drafts.tokens.get(r.request_id, []) for r in reqs])
        if all(r.params.greedy for r in reqs):
            tokens = greedy_tokens(logits).tolist()
        else:  # the draft races on the noise the target will race on at this output position (rejection.py)
            rows = SamplingRows.from_params([r.params for r in reqs], self.model.args.vocab_size, self.device)
            q = logits_to_probs(logits, rows)  # greedy rows: one-hot, so the race picks their argmax
            keys = [r.noise_key(len(drafts.tokens.get(r.request_id, []))) for r in reqs]
            tokens = race(q, position_noise(keys, q.shape[-1], q.device)).tolist()
            for i, r in enumerate(reqs):
                if r.verifies_by_rejection:
                    probs[r.request_id].append(q[i])
        for r, t in zip(reqs, tokens, strict=True):
            drafts.tokens.setdefault(r.request_id, []).append(int(t))
            n = walked.get(r.request_id, 0)
            if r.grammar is not None and n >= 0:  # -(accepted + 1) once the matcher refuses or ends: stop walking
                if not r.grammar.accept(int(t)):
                    walked[r.request_id] = -(n + 1)
                else:  # a terminated matcher is never fed again (xgrammar warns on stderr when it is)
                    walked[r.request_id] = -(n + 2) if r.grammar.is_terminated else n + 1
        seconds = time.perf_counter() - started
        drafts.forward_seconds.append((batch.num_tokens, seconds))
        if self.rollout is not None:
            self.rollout.eager_cost.observe(batch.num_tokens, seconds)
