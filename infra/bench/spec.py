"""Speculative decoding, measured: c=1 latency and tokens/s with spec off / draft / n-gram, the same pair
through transformers' assisted generation and prompt lookup, spec-on ÷ spec-off throughput across
concurrency, acceptance, and the ceiling a pair can reach. Greedy, fixed output length, held-out prompts.
Used by `specdeploy bench spec`.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from infra.bench.step_profile import profile_steps
from serving.config import DecodeAttentionMode, DraftRolloutMode, Dtype, RolloutWrapper, WeightPacking
from serving.engine.batch import SequenceInput, build_forward_batch
from serving.engine.config import CompileMode, EngineConfig, SpeculativeConfig
from serving.engine.engine import LLMEngine
from serving.engine.kv_cache import BlockManager, KVCache
from serving.engine.model import Transformer
from serving.engine.sampling import greedy_tokens
from serving.engine.spec.rollout import DraftRollout
from serving.engine.timing import forward_seconds
from serving.engine.types import GenerationRequest, SamplingParams
from serving.stats import percentile

log = logging.getLogger(__name__)


@dataclass
class LatencyRun:
    system: str  # spec_off, spec_draft, spec_ngram, hf_generate, hf_assisted, hf_prompt_lookup
    requests: int
    output_tokens: int
    tokens_per_s: float
    p50_latency_s: float
    p99_latency_s: float
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None  # tokens per verification (accepted drafts + 1)
    note: str = ""


@dataclass
class PromptLatency:
    """One c=1 prompt over every pass: median end-to-end seconds per system, and the tokens each speculating
    system emitted per verification of it. The P99 of a c=1 run is its slowest requests, so this says which
    prompts set it and why (a prompt the draft predicts poorly runs more, shorter rounds)."""

    prompt: int  # index in the held-out prompt set
    prompt_tokens: int
    seconds: dict[str, float]  # system -> median latency over the passes
    tokens_per_round: dict[str, float]  # speculating system -> (accepted drafts + verifications) / verifications

    @property
    def draft_speedup(self) -> float | None:
        off, draft = self.seconds.get("spec_off"), self.seconds.get("spec_draft")
        return off / draft if off and draft else None


@dataclass
class ThroughputRun:
    concurrency: int
    spec_off_tokens_per_s: float
    spec_draft_tokens_per_s: float
    spec_ngram_tokens_per_s: float
    draft_on_over_off: float
    ngram_on_over_off: float
    draft_k_histogram: dict[int, int] = field(default_factory=dict)  # k chosen -> sequence-steps, all repeats


@dataclass
class SpecBenchReport:
    target: str
    draft: str
    threads: int
    num_draft_tokens: int
    prompts: int
    output_len: int
    compile: str = "auto"  # model.compile of every engine measured (on: target and draft steps compiled)
    adaptive: bool = True  # False: every speculating step drafts k tokens (the policy does not choose)
    c1: list[LatencyRun] = field(default_factory=list)
    throughput: list[ThroughputRun] = field(default_factory=list)
    ceiling: dict[str, float] = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)
    greedy_identical: bool | None = None  # c=1 outputs token-identical with spec off, draft and n-gram
    # alpha[i]: P(draft position i accepted | positions before it accepted), greedy, teacher-forced on the
    # target's own c=1 outputs (so independent of the k the policy picked)
    draft_alpha: list[float] = field(default_factory=list)
    c1_draft_k_histogram: dict[int, int] = field(default_factory=dict)  # k chosen -> sequence-steps, c=1 run
    # median over (round, prompt) of spec-off latency ÷ draft latency, the two run back to back: the c=1 speed-up
    # least moved by a shared machine's drift
    c1_draft_paired_speedup: float | None = None
    c1_rounds: int = 1  # passes over the prompts at c=1, each prompt on every system back to back
    c1_prompts: list[PromptLatency] = field(default_factory=list)  # per prompt, in the held-out set's order
    weight_packing: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # engine -> PackingDecision per model
    draft_rollout: dict[str, Any] | None = None  # the draft engine's RolloutDecision (speculative.draft_rollout)
    draft_token_map: str | None = None  # speculative.draft_token_map of the draft engine (None: full vocabulary)
    draft_token_map_size: int | None = None  # the tokens the draft may propose under it
    # engine -> AttentionDecision per model (model.cpu_decode_attention)
    decode_attention: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    draft_rollouts: int = 0  # compiled rollouts the draft engine ran over the whole bench
    counters: dict[str, dict[str, Any]] = field(default_factory=dict)  # proposer -> its engine's SpecStats, whole run
    # where a c=1 step goes, spec off and draft (one more sequential pass each, profiled: StepBreakdown fields)
    c1_step_split: dict[str, dict[str, Any]] = field(default_factory=dict)
    decisions: dict[str, list[tuple[str, str, str]]] = field(default_factory=dict)  # engine -> start-up decisions

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for row, prompt in zip(out["c1_prompts"], self.c1_prompts, strict=True):
            row["draft_speedup"] = prompt.draft_speedup
        return out

    def c1_run(self, system: str) -> LatencyRun | None:
        return next((r for r in self.c1 if r.system == system and r.tokens_per_s > 0), None)


def make_engine(target: Path, spec: SpeculativeConfig, max_concurrency: int, threads: int | str = "auto",
                compile_mode: CompileMode = "auto", dtype: Dtype = "auto",
                weight_packing: WeightPacking = "auto", decode_attention: DecodeAttentionMode = "auto") -> LLMEngine:
    """An engine on the server's defaults but for what the bench's flags set."""
    return LLMEngine.from_config(EngineConfig(
        model=str(target), device="cpu",
        max_concurrency=max(max_concurrency, EngineConfig.model_fields["max_concurrency"].default),
        num_threads=threads, speculative=spec, compile=compile_mode,
        dtype=dtype, cpu_weight_packing=weight_packing, cpu_decode_attention=decode_attention,
    ))


def run_one(engine: LLMEngine, request_id: str, prompt: list[int], output_len: int) -> tuple[float, list[int]]:
    """One request alone on the engine, greedy: (end-to-end seconds, generated tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(GenerationRequest(request_id, prompt, params))
    generated: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            generated += out.new_token_ids
    return time.perf_counter() - start, generated


def _spec_counts(engine: LLMEngine) -> tuple[int, int, int]:
    spec = engine.stats().spec
    return spec.num_draft_tokens, spec.num_accepted_tokens, spec.num_drafts


def _round_length(accepted: int, rounds: int) -> float | None:
    """Tokens a verification emitted: its accepted drafts and the target's own token."""
    return (accepted + rounds) / rounds if rounds else None


def _latency_run(system: str, latencies: list[float], tokens: int, counts: tuple[int, int, int]) -> LatencyRun:
    drafted, accepted, rounds = counts
    return LatencyRun(
        system, len(latencies), tokens, tokens / sum(latencies), statistics.median(latencies),
        percentile(latencies, 99) or 0.0,
        acceptance_rate=accepted / drafted if drafted else None,
        mean_accepted_length=_round_length(accepted, rounds),
    )


def run_sequential(
    engine: LLMEngine, system: str, prompts: list[list[int]], output_len: int, outputs: list[list[int]] | None = None
) -> LatencyRun:
    """c=1: one request at a time, end-to-end latency per request (generated tokens appended to outputs)."""
    latencies, tokens = [], 0
    before = _spec_counts(engine)
    for i, prompt in enumerate(prompts):
        seconds, generated = run_one(engine, f"{system}-{i}", prompt, output_len)
        latencies.append(seconds)
        tokens += len(generated)
        if outputs is not None:
            outputs.append(generated)
    after = _spec_counts(engine)
    return _latency_run(system, latencies, tokens, (after[0] - before[0], after[1] - before[1], after[2] - before[2]))


def run_interleaved(
    engines: dict[str, LLMEngine], prompts: list[list[int]], output_len: int, rounds: int,
    per_prompt: list[PromptLatency] | None = None,
) -> tuple[list[LatencyRun], dict[str, list[list[int]]], list[float]]:
    """c=1 on several engines side by side: each prompt runs on every engine back to back (the order rotating
    from prompt to prompt), for `rounds` passes over the prompts. A slow stretch of a shared machine then
    lands on all systems alike instead of on whichever ran during it.

    Returns a LatencyRun per system over all its requests, each system's outputs (round by round, prompt by
    prompt), and for every (round, prompt) the first system's latency over the second's: the paired ratios.
    per_prompt, when given, gets a PromptLatency per prompt."""
    systems = list(engines)
    latencies: dict[str, list[float]] = {s: [] for s in systems}
    tokens = dict.fromkeys(systems, 0)
    outputs: dict[str, list[list[int]]] = {s: [] for s in systems}
    paired: list[float] = []
    # prompt -> system -> its latencies, and its (drafted, accepted, verifications) summed over the passes
    by_prompt: list[dict[str, list[float]]] = [{s: [] for s in systems} for _ in prompts]
    verified: list[dict[str, list[int]]] = [{s: [0, 0, 0] for s in systems} for _ in prompts]
    for r in range(rounds):
        for i, prompt in enumerate(prompts):
            shift = (r * len(prompts) + i) % len(systems)
            seconds = {}
            for system in systems[shift:] + systems[:shift]:
                before = _spec_counts(engines[system])
                seconds[system], generated = run_one(engines[system], f"{system}-{r}-{i}", prompt, output_len)
                for j, (start, end) in enumerate(zip(before, _spec_counts(engines[system]), strict=True)):
                    verified[i][system][j] += end - start
                latencies[system].append(seconds[system])
                by_prompt[i][system].append(seconds[system])
                tokens[system] += len(generated)
                outputs[system].append(generated)
            if len(systems) >= 2:
                paired.append(seconds[systems[0]] / seconds[systems[1]])
    runs = []
    for system in systems:
        drafted, accepted, rounds_ = (sum(v[system][j] for v in verified) for j in range(3))
        runs.append(_latency_run(system, latencies[system], tokens[system], (drafted, accepted, rounds_)))
    if per_prompt is not None:
        for i, prompt in enumerate(prompts):
            lengths = {s: _round_length(a, n) for s, (_, a, n) in verified[i].items()}
            per_prompt.append(PromptLatency(i, len(prompt), {s: statistics.median(t) for s, t in by_prompt[i].items()},
                                            {s: length for s, length in lengths.items() if length is not None}))
    return runs, outputs, paired


def run_concurrent(engine: LLMEngine, prompts: list[list[int]], concurrency: int, output_len: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(GenerationRequest(f"c{concurrency}-{i}-{time.monotonic_ns()}",
                                             prompts[i % len(prompts)], params))
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - start)


def run_hf(model: Any, system: str, prompts: list[list[int]], output_len: int, **generate_kwargs: Any) -> LatencyRun:
    latencies, tokens = [], 0
    for prompt in prompts:
        ids = torch.tensor([prompt])
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=0, **generate_kwargs)
        latencies.append(time.perf_counter() - start)
        tokens += int(out.shape[1] - ids.shape[1])
    return LatencyRun(system, len(prompts), tokens, tokens / sum(latencies), statistics.median(latencies),
                      percentile(latencies, 99) or 0.0)


def measure_ceiling(target: Transformer, draft: Transformer | None, k: int, context: int = 128,
                    rollout: DraftRollout | None = None) -> dict[str, float]:
    """Speed-up at full acceptance: (k + 1) decode steps replaced by one verify of k + 1 tokens and the drafting
    of k tokens: k eager draft steps, or, where the draft's compiled rollout serves a lone sequence (the c=1
    path), one rollout. Priced with eager steps only, the rollout's c=1 figures read below what was measured."""
    decode = forward_seconds(target, context, 1)
    verify = forward_seconds(target, context, k + 1)
    draft_step = forward_seconds(draft, context, 1) if draft is not None else 0.0
    drafting = rollout_seconds(rollout, context) if rollout is not None else k * draft_step
    return {
        "target_decode_step_s": decode,
        "target_verify_step_s": verify,
        "draft_step_s": draft_step,
        "draft_rollout_s": drafting if rollout is not None else 0.0,  # 0: no rollout, drafts are eager steps
        "drafting_s": drafting,  # k drafts for one sequence, as the c=1 path drafts them
        "draft_cost_per_token_s": drafting / k,
        "verify_cost_per_token_s": verify / (k + 1),
        "draft_ceiling_speedup": (k + 1) * decode / (verify + drafting),
        "ngram_ceiling_speedup": (k + 1) * decode / verify,
    }


@torch.inference_mode()
def rollout_seconds(rollout: DraftRollout, context: int, repeats: int = 7) -> float:
    """One compiled rollout for one sequence with `context` cached tokens: the median of `repeats`."""
    inputs = rollout.inputs(1, context)
    rollout.timed(inputs)
    return statistics.median(rollout.timed(inputs) for _ in range(repeats))


@torch.inference_mode()
def draft_agreement(draft: Transformer, prompt: list[int], out: list[int]) -> list[bool]:
    """agree[i]: the draft's greedy token after prompt + out[:i] is out[i] (one teacher-forced forward)."""
    args = draft.args
    device, dtype = draft.tok_embeddings.weight.device, draft.tok_embeddings.weight.dtype
    tokens = prompt + out[:-1]
    blocks = BlockManager(-(-len(tokens) // 16), 16)
    cache = KVCache(args.n_layers, blocks.num_blocks, 16, args.n_kv_heads, args.head_dim, dtype, device)
    blocks.allocate("s", len(tokens))
    rows = list(range(len(prompt) - 1, len(tokens)))  # logits predicting out[0], out[1], ...
    batch = build_forward_batch([SequenceInput(tokens, 0, blocks.block_table("s"), rows)], 16, args.n_rep,
                                device, dtype)
    guesses = greedy_tokens(draft.compute_logits(draft(batch, cache), batch.logits_index)).cpu()
    return (guesses == torch.tensor(out)).tolist()


def alpha_per_position(agreements: list[list[bool]], k: int) -> list[float]:
    """Acceptance per draft position for greedy speculation, from draft_agreement over the target's greedy
    continuations: position i of a round starting at t is accepted when the draft agrees with the target at
    t .. t + i. alpha[i] = rounds reaching i + 1 / rounds reaching i, over a round starting at every t."""
    reached = [0] * (k + 1)  # reached[i]: round starts whose first i drafts were all accepted
    for agree in agreements:
        for start in range(len(agree) - k):
            run = 0
            while run < k and agree[start + run]:
                run += 1
            for i in range(run + 1):
                reached[i] += 1
    return [reached[i + 1] / reached[i] if reached[i] else 0.0 for i in range(k)]


def tokens_per_round(agreements: list[list[bool]], k: int) -> float:
    """Tokens a greedy round of k drafts emits on average (accepted drafts and the target's own token), replaying
    speculation over the target's outputs as the engine runs it: the prefill emits out[0], a round starting at t
    accepts the drafts that agree from t on (at most k, and none past the output's end) and emits one more, and
    the next round starts after it. As the engine's mean accepted length, it counts rounds that drafted. Exact
    for greedy drafts at a fixed k, since accepted drafts are the target's tokens and the draft then sees the same
    prefix as in the teacher-forced forward. Rounds start after rejections, where agreement is lower, so this is
    below the product of alpha per position, which counts a round starting at every t."""
    tokens = rounds = 0
    for agree in agreements:
        t = 1
        while t < len(agree) - 1:  # a last token alone is a plain decode step: no room for a draft
            run = 0
            while run < k and t + run < len(agree) - 1 and agree[t + run]:
                run += 1
            tokens += run + 1
            rounds += 1
            t += run + 1
    return tokens / rounds if rounds else 0.0


def expected_speedup(round_tokens: float, ceiling: dict[str, float]) -> float:
    """Speed-up at c=1: tokens a round (tokens_per_round) in decode steps / the cost of a round (a verify of k + 1
    tokens and the drafting of k). Prefill and the engine's own per-step work are not in it."""
    cost = ceiling["target_verify_step_s"] + ceiling["drafting_s"]
    return round_tokens * ceiling["target_decode_step_s"] / cost if cost else 0.0


def load_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    from serving.demo import load_prompts as demo_prompts

    texts = [p.prompt for p in demo_prompts("code")[:count]]
    return [tokenizer(t, add_special_tokens=False)["input_ids"][-256:] for t in texts]


def run_spec_benchmark(
    target: Path,
    draft: Path,
    concurrencies: list[int],
    output_len: int,
    num_prompts: int,
    k: int | None = None,
    threads: int | str = "auto",
    baselines: bool = True,
    repeats: int = 2,
    compile_mode: CompileMode = "auto",
    adaptive: bool = True,
    dtype: Dtype = "auto",
    weight_packing: WeightPacking = "auto",
    draft_rollout: DraftRolloutMode = "auto",
    rollout_wrapper: RolloutWrapper = "cpp",
    decode_attention: DecodeAttentionMode = "auto",
    policy_trace: list[dict[str, Any]] | None = None,
    draft_token_map: str | None = "auto",
) -> SpecBenchReport:
    """policy_trace: when given, every choice of the draft and n-gram engines' policies is appended to it
    (SpeculationPolicy.describe, with "system" and "phase": warm-up, c1-latency, c1-profile, throughput-c4, ...)."""
    k = SpeculativeConfig().num_draft_tokens if k is None else k  # the server's default unless given
    max_c = max(concurrencies)
    engine_args = (max_c, threads, compile_mode, dtype, weight_packing, decode_attention)
    off = make_engine(target, SpeculativeConfig(enabled=False), *engine_args)
    on_draft = make_engine(target, SpeculativeConfig(enabled=True, method="draft", draft_model=str(draft),
                                                     num_draft_tokens=k, adaptive=adaptive,
                                                     draft_rollout=draft_rollout,
                                                     draft_rollout_wrapper=rollout_wrapper,
                                                     draft_token_map=draft_token_map), *engine_args)
    on_ngram = make_engine(target, SpeculativeConfig(enabled=True, method="ngram", num_draft_tokens=k,
                                                     adaptive=adaptive), *engine_args)
    if off.tokenizer is None:
        raise ValueError(f"{target} has no tokenizer: the spec benchmark encodes the held-out text prompts")
    prompts = load_prompts(off.tokenizer, num_prompts)
    report = SpecBenchReport(str(target), str(draft), torch.get_num_threads(), k, len(prompts), output_len,
                             compile_mode, adaptive)
    systems = {"spec_off": off, "spec_draft": on_draft, "spec_ngram": on_ngram}
    phase = ["warm-up"]
    if policy_trace is not None:
        for system, engine in (("draft", on_draft), ("ngram", on_ngram)):
            if engine.speculator is not None:
                engine.speculator.trace = functools.partial(_trace_into, policy_trace, system, phase)
    report.weight_packing = {name: [asdict(d) for d in engine.runner.weight_packing]
                             for name, engine in systems.items()}
    report.decode_attention = {name: [asdict(d) for d in engine.runner.decode_attention]
                               for name, engine in systems.items()}
    report.draft_rollout = asdict(on_draft.runner.draft_rollout) if on_draft.runner.draft_rollout is not None else None
    proposer = on_draft.speculator.proposer if on_draft.speculator is not None else None
    report.draft_token_map = getattr(proposer, "token_map", None)  # as resolved (auto: the draft's own, if any)
    report.draft_token_map_size = getattr(proposer, "token_map_size", None)
    report.decisions = {name: engine.startup_decisions for name, engine in systems.items()}

    for engine in (off, on_draft, on_ngram):  # warm-up, and a first fit of the policy's cost model
        run_concurrent(engine, prompts, 2, 16)
    # c=1 side by side: every prompt on spec off, draft and n-gram back to back, `repeats` passes
    k_before = dict(on_draft.stats().spec.k_histogram)
    phase[0] = "c1-latency"
    report.c1_rounds = max(repeats, 1)
    runs, outputs, paired = run_interleaved(systems, prompts, output_len, report.c1_rounds, report.c1_prompts)
    report.c1 += runs
    report.c1_draft_paired_speedup = statistics.median(paired)
    report.c1_draft_k_histogram = {kk: v - k_before.get(kk, 0) for kk, v in on_draft.stats().spec.k_histogram.items()
                                   if v - k_before.get(kk, 0)}
    # every pass of every prompt: greedy is deterministic, so each system must give spec off's tokens every time
    report.greedy_identical = outputs["spec_off"] == outputs["spec_draft"] == outputs["spec_ngram"]
    phase[0] = "c1-profile"
    for system, engine in (("spec_off", off), ("spec_draft", on_draft)):
        split = profile_steps(engine, functools.partial(run_sequential, engine, system, prompts, output_len), 1)
        report.c1_step_split[system] = asdict(split)
    for run in report.c1:
        log.info("c=1 %s: %.1f tok/s, p50 %.2fs", run.system, run.tokens_per_s, run.p50_latency_s)

    if baselines:
        from transformers import AutoModelForCausalLM

        hf: Any = AutoModelForCausalLM.from_pretrained(target, dtype=off.dtype).eval()
        hf_draft: Any = AutoModelForCausalLM.from_pretrained(draft, dtype=off.dtype).eval()
        run_hf(hf, "warmup", prompts[:1], 8)
        report.c1.append(run_hf(hf, "hf_generate", prompts, output_len))
        for system, kwargs in (("hf_assisted", {"assistant_model": hf_draft}),
                               ("hf_prompt_lookup", {"prompt_lookup_num_tokens": k})):
            try:
                report.c1.append(run_hf(hf, system, prompts, output_len, **kwargs))
            except Exception as exc:  # reported, not fatal
                log.warning("%s failed: %s", system, exc)
                report.c1.append(LatencyRun(system, 0, 0, 0.0, 0.0, 0.0, note=f"failed: {exc}"[:200]))

    for c in concurrencies:
        phase[0] = f"throughput-c{c}"
        before = dict(on_draft.stats().spec.k_histogram)
        # interleaved, best of `repeats`: the machine is shared, and a slow moment should not decide a ratio
        t_off = t_draft = t_ngram = 0.0
        for _ in range(repeats):
            t_off = max(t_off, run_concurrent(off, prompts, c, output_len))
            t_draft = max(t_draft, run_concurrent(on_draft, prompts, c, output_len))
            t_ngram = max(t_ngram, run_concurrent(on_ngram, prompts, c, output_len))
        after = on_draft.stats().spec.k_histogram
        hist = {kk: v - before.get(kk, 0) for kk, v in after.items() if v - before.get(kk, 0)}
        report.throughput.append(ThroughputRun(c, t_off, t_draft, t_ngram, t_draft / t_off, t_ngram / t_off, hist))
        log.info("c=%d: off %.0f, draft %.0f, ngram %.0f tok/s", c, t_off, t_draft, t_ngram)

    for name, engine in (("draft", on_draft), ("ngram", on_ngram)):
        stats = engine.stats().spec
        report.counters[name] = dict(asdict(stats), acceptance_rate=stats.acceptance_rate,
                                     mean_accepted_length=stats.mean_accepted_length)
    proposer = on_draft.speculator.proposer if on_draft.speculator else None
    draft_model = getattr(proposer, "model", None)
    report.draft_rollouts = getattr(proposer, "rollouts_total", 0)
    report.ceiling = measure_ceiling(off.model, draft_model, k, rollout=getattr(proposer, "rollout", None))
    if draft_model is not None:
        first_pass = outputs["spec_off"][: len(prompts)]
        agreements = [draft_agreement(draft_model, p, o) for p, o in zip(prompts, first_pass, strict=True)
                      if len(o) >= 2]
        report.draft_alpha = alpha_per_position(agreements, k)
        round_tokens = tokens_per_round(agreements, k)
        report.ceiling["draft_tokens_per_round"] = round_tokens  # replayed at k, greedy
        report.ceiling["draft_expected_speedup_at_alpha"] = expected_speedup(round_tokens, report.ceiling)
    report.ratios = spec_ratios(report)
    return report


def _trace_into(records: list[dict[str, Any]], system: str, phase: list[str], described: dict[str, object]) -> None:
    records.append({"system": system, "phase": phase[0], **described})


def spec_ratios(report: SpecBenchReport) -> dict[str, float]:
    ratios: dict[str, float] = {}
    off, draft, ngram = report.c1_run("spec_off"), report.c1_run("spec_draft"), report.c1_run("spec_ngram")
    assisted, lookup = report.c1_run("hf_assisted"), report.c1_run("hf_prompt_lookup")
    if off and draft:
        ratios["c1_draft_over_off"] = draft.tokens_per_s / off.tokens_per_s  # goal >= 2.5
        ratios["c1_draft_p99_over_off_p99"] = draft.p99_latency_s / off.p99_latency_s  # goal <= 0.5
    if report.c1_draft_paired_speedup is not None:
        ratios["c1_draft_paired_speedup"] = report.c1_draft_paired_speedup
    if off and ngram:
        ratios["c1_ngram_over_off"] = ngram.tokens_per_s / off.tokens_per_s
        ratios["c1_ngram_p99_over_off_p99"] = ngram.p99_latency_s / off.p99_latency_s
    if draft and assisted:
        ratios["c1_draft_over_hf_assisted"] = draft.tokens_per_s / assisted.tokens_per_s  # goal >= 1.3
    if ngram and lookup:
        ratios["c1_ngram_over_hf_prompt_lookup"] = ngram.tokens_per_s / lookup.tokens_per_s
    for run in report.throughput:
        ratios[f"c{run.concurrency}_draft_on_over_off"] = run.draft_on_over_off  # goal >= 0.97
        ratios[f"c{run.concurrency}_ngram_on_over_off"] = run.ngram_on_over_off
    return ratios
