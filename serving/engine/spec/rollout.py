"""A draft model's catch-up and greedy drafts as one compiled graph (`speculative.draft_rollout`).

Step by step, a draft model proposes k tokens with k forwards: a catch-up forward over the tokens it has not
seen (after a verification: the target's bonus token, and the last draft when every draft was accepted), which
drafts the first token, then k - 1 forwards of one token each. For a small draft on CPU such a forward is mostly
dispatch, not arithmetic: the demo draft's 80-odd eager ops and the step's batch metadata take 0.31 ms with its
weights hot in cache. `DraftRollout` runs the whole sequence as one graph compiled by inductor, each step's
argmax feeding the next step's embedding:

    context K/V, gathered once from the draft's paged cache ──────────────┐
    forced tokens (catch-up), lag ──► [embed → L × (norm, qkv, RoPE, attention over context + the keys made
                                       in this rollout, o-proj, norm, SwiGLU) → norm → lm_head → argmax]
                                       × steps ──► argmax per step, K/V of every fed token

`steps` = k_max + MAX_LAG - 1 single-token steps: the first `lag` feed the sequence's own unseen tokens, the
rest feed drafts. Attention over the cached context and over the rollout's own keys is one softmax over both
score sets (concatenated scores, never a concatenated K), so only the score row grows with the context. The
K/V of the fed tokens come out of the graph and are stored in the draft cache with one copy per tensor, at the
slots of the positions the sequence keeps (up to its last draft but one, as step by step); a sequence whose k
is smaller than the rollout's has its extra steps dropped.

The graph is compiled at start-up, before ready, for one sequence, with the context length symbolic. It
serves the steps where a single sequence drafts: batch-1 latency, which speculation exists for. With several
sequences drafting, one batched eager forward per position serves them all; a graph for 2 or more sequences
was built and measured, and the cost rule below almost never chose it (docs/benchmarks/log.md), so it is not
compiled. Serving never compiles: a call that the graph's guards refuse turns the rollout off with a
warning, and drafting goes on step by step.

Only greedy drafting is rolled out: sampled drafts need their distributions q for rejection sampling, and
grammar masks and logit adjustments apply between steps. Those requests, sequences whose draft lags by more
than MAX_LAG tokens (a first catch-up over the prompt) and sequences near the context limit stay step by
step. A rollout is used only where it is expected to cost less than the step-by-step forwards it replaces
(both costs fitted online, starting from the start-up measurement): a sequence that drafts k = 2 does not
pay for 9 steps. Drafts are proposals only: a rollout that rounded differently from the step-by-step path
could change acceptance, never the output, since verification against the target decides every token.

The graph function takes a batch of G sequences (the reference test runs two, eager); only G = 1 is compiled.

What calls the compiled kernels (`speculative.draft_rollout_wrapper`): `cpp`, the default, has inductor write that
caller in C++; its Python one had been a third of a rollout (0.85 against 1.19 ms for the demo draft), at the
price of a longer first compile (~40 s against ~4 s here; inductor's cache serves later starts). A cpp build that
fails falls back to the Python wrapper, and the decision says so. `DraftRollout` built directly (the tests) uses
the Python wrapper unless told otherwise.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass

import torch

from serving.config import DraftRolloutMode, RolloutWrapper
from serving.engine.kernels.cpu_linear import PackedLinear
from serving.engine.model import Transformer, TransformerBlock
from serving.engine.rope import apply_rope
from serving.engine.spec.policy import LinearCost
from serving.engine.timing import forward_seconds, interleaved_medians

log = logging.getLogger(__name__)

MAX_LAG = 2  # unseen tokens a rollout feeds before drafting: the bonus token, and the last draft if all were accepted
_CONTEXT = 256  # cached tokens in the start-up measurement
_ROUNDS = 7  # interleaved timing rounds in `auto`
_TOLERANCE = 0.95  # `auto` keeps the rollout if it takes under this share of the step-by-step forwards' time
_WARM_CONTEXT = 48  # warm-up context (a size no model dimension shares, so the symbolic one is not specialised)

# (forced [steps, G], lag [G], positions [G], k_ctx [L, G, C, Hkv, D], v_ctx, ctx_len [G]): rollout_graph's inputs
Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class RolloutDecision:
    enabled: bool
    reason: str  # why (the measurement, or why the rollout does not apply)
    steps: int = 0  # single-token steps per rollout
    compile_s: float | None = None  # compiling both graphs at start-up
    eager_ms: float | None = None  # the same steps as eager forwards through the engine's path, one sequence
    rollout_ms: float | None = None  # one compiled rollout, one sequence
    wrapper: str | None = None  # speculative.draft_rollout_wrapper, where it was compiled


def unsupported_reason(model: Transformer, num_draft_tokens: int) -> str | None:
    """Why a compiled rollout cannot serve this draft, or None."""
    if model.device.type != "cpu":
        return f"device {model.device.type}: there the draft's steps are compiled and captured by model.compile"
    if num_draft_tokens < 2:
        return "num_draft_tokens is 1: a single draft is one forward either way"
    if model.quantization != "none":
        return f"the draft is quantized ({model.quantization})"
    if any(isinstance(m, PackedLinear) for m in model.modules()):
        return "the draft's weights are packed for oneDNN (model.cpu_weight_packing), which inductor cannot lower"
    if not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        return "no C++ compiler on PATH (inductor needs one to compile on CPU)"
    return None


def rollout_graph(model: Transformer, forced: torch.Tensor, lag: torch.Tensor, positions: torch.Tensor,
                  k_ctx: torch.Tensor, v_ctx: torch.Tensor, ctx_len: torch.Tensor, steps: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`steps` single-token decode steps of G sequences, greedy.

    Step j feeds each sequence the token at position positions + j: its own token forced[j] while j < lag (the
    tokens the draft has not seen yet, its catch-up), then the argmax of step j - 1 (its drafts).
    forced [steps, G], lag [G] (>= 1), positions [G]: the first fed token's position (= ctx_len).
    k_ctx, v_ctx [L, G, C, Hkv, D]: each sequence's cached context, padded to C; ctx_len [G] its true length.
    Returns every step's argmax [steps, G] and the K/V of the fed tokens [steps, L, G, Hkv, D] each."""
    args = model.args
    g, c = forced.shape[1], k_ctx.shape[2]
    n_q, n_kv, d, rep = args.n_heads, args.n_kv_heads, args.head_dim, args.n_rep
    pad = torch.arange(c, device=forced.device)[None, :] >= ctx_len[:, None]  # [G, C]
    pad = pad[:, None, None, :]  # [G, 1, 1, C]: over KV heads and their query heads
    new_k: list[list[torch.Tensor]] = [[] for _ in model.layers]  # per layer, per step: [G, Hkv, D]
    new_v: list[list[torch.Tensor]] = [[] for _ in model.layers]
    out: list[torch.Tensor] = []
    tokens = forced[0]
    for j in range(steps):
        if j > 0:
            tokens = torch.where(lag > j, forced[j], out[-1])
        pos = positions + j
        x = model.tok_embeddings(tokens)  # [G, dim]
        cos = model.rope_cos[pos].to(x.dtype).unsqueeze(1)  # [G, 1, D]
        sin = model.rope_sin[pos].to(x.dtype).unsqueeze(1)
        for i, block in enumerate(model.layers):
            assert isinstance(block, TransformerBlock)
            attn = block.attention
            qkv = attn.wqkv(block.attention_norm(x)).view(g, n_q + 2 * n_kv, d)
            qk = apply_rope(qkv[:, : n_q + n_kv], cos, sin)
            q = qk[:, :n_q].reshape(g, n_kv, rep, d)
            new_k[i].append(qk[:, n_q:])
            new_v[i].append(qkv[:, n_q + n_kv :])
            k_new = torch.stack(new_k[i], 1)  # [G, j + 1, Hkv, D]
            v_new = torch.stack(new_v[i], 1)
            s_ctx = torch.einsum("ghrd,gchd->ghrc", q, k_ctx[i]).masked_fill(pad, float("-inf"))
            s_new = torch.einsum("ghrd,gjhd->ghrj", q, k_new)
            p = torch.softmax(torch.cat([s_ctx, s_new], -1) * attn.scale, dim=-1)
            o = torch.einsum("ghrc,gchd->ghrd", p[..., :c], v_ctx[i]) + torch.einsum(
                "ghrj,gjhd->ghrd", p[..., c:], v_new)
            h = x + attn.wo(o.reshape(g, n_q * d))
            x = h + block.feed_forward(block.ffn_norm(h))
        out.append(model.output(model.norm(x)).argmax(-1))
    k_out = torch.stack([torch.stack(per_step, 0) for per_step in new_k], 1)  # [steps, L, G, Hkv, D]
    v_out = torch.stack([torch.stack(per_step, 0) for per_step in new_v], 1)
    return torch.stack(out), k_out, v_out


class DraftRollout:
    """`rollout_graph` for one draft model, compiled at start-up for one sequence.

    Also keeps the two cost models that decide, call by call, whether rolling out is cheaper than the
    step-by-step forwards: seconds per rollout, and seconds per eager forward by tokens."""

    def __init__(self, model: Transformer, num_draft_tokens: int, wrapper: RolloutWrapper = "python") -> None:
        self.model = model
        self.steps = num_draft_tokens + MAX_LAG - 1
        self.always = False  # `on`: roll out wherever it applies, without weighing the costs
        self.wrapper = wrapper
        # cpp: inductor writes the code that calls the graph's ~200 kernels in C++ rather than Python, which took
        # a third of a rollout (speculative.draft_rollout_wrapper; docs/benchmarks/log.md)
        self._graph = torch.compile(rollout_graph, fullgraph=True, options={"cpp_wrapper": wrapper == "cpp"})
        self.rollout_cost = LinearCost(intercept=1e-3, slope=0.0)  # seconds per rollout (x: sequences, always 1)
        self.eager_cost = LinearCost(intercept=3e-4, slope=5e-5)  # seconds per eager draft forward, x = tokens

    def inputs(self, rows: int, context: int) -> Inputs:
        """Dummy inputs of the given batch and context size (token 1 everywhere, every row lagging by one)."""
        a, dev = self.model.args, self.model.device
        k = torch.zeros(a.n_layers, rows, context, a.n_kv_heads, a.head_dim, dtype=self.model.dtype, device=dev)
        ctx = torch.full((rows,), context, dtype=torch.long, device=dev)
        forced = torch.ones(self.steps, rows, dtype=torch.long, device=dev)
        return forced, torch.ones(rows, dtype=torch.long, device=dev), ctx, k, k.clone(), ctx.clone()

    @torch.inference_mode()
    def compile(self) -> float:
        """Compile the graph for one sequence, the context length symbolic; seconds taken."""
        started = time.perf_counter()
        inputs = self.inputs(1, _WARM_CONTEXT)
        for t in inputs[3:5]:  # k_ctx, v_ctx: [L, 1, C, Hkv, D]
            torch._dynamo.mark_dynamic(t, 2)
        self._graph(self.model, *inputs, self.steps)
        return time.perf_counter() - started

    def __call__(self, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """rollout_graph's outputs from the compiled graph; never compiles (raises instead)."""
        with torch.compiler.set_stance("fail_on_recompile"):
            return self._graph(self.model, *inputs, self.steps)

    def timed(self, inputs: Inputs) -> float:
        """Seconds of one compiled rollout over these inputs, its drafts read back as the proposer reads them."""
        start = time.perf_counter()
        self(inputs)[0].tolist()
        return time.perf_counter() - start

    def eager(self, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return rollout_graph(self.model, *inputs, self.steps)

    @torch.inference_mode()
    def measure(self) -> tuple[float, float]:
        """Seconds of one compiled rollout and of its steps as eager forwards (one sequence, _CONTEXT cached
        tokens), medians of interleaved rounds; seeds the cost models."""
        one = self.inputs(1, _CONTEXT)
        self(one)
        forward_seconds(self.model, _CONTEXT, 1, repeats=3)
        rollout_s, forward_s = interleaved_medians(
            [lambda: self.timed(one), lambda: forward_seconds(self.model, _CONTEXT, 1, repeats=3)], _ROUNDS)
        self.rollout_cost = LinearCost(intercept=rollout_s, slope=0.0)
        # a catch-up forward feeds 1-2 tokens: the slope from a 2-token forward, the line through the 1-token one
        slope = min(max(forward_seconds(self.model, _CONTEXT, 2, repeats=3) - forward_s, 0.0), forward_s)
        self.eager_cost = LinearCost(intercept=forward_s - slope, slope=slope)
        return rollout_s, forward_s * self.steps

    def pays(self, forwards: list[int]) -> bool:
        """Whether one rollout is expected to cost less than the eager forwards it replaces (their token
        counts: the catch-up forward, then one per further draft position)."""
        return self.always or self.rollout_cost(1) < sum(self.eager_cost(n) for n in forwards)


def prepare(model: Transformer, mode: DraftRolloutMode, num_draft_tokens: int, wrapper: RolloutWrapper = "cpp"
            ) -> tuple[DraftRollout | None, RolloutDecision]:
    """speculative.draft_rollout at start-up: compile (and in auto, measure) or say why not."""
    if mode == "off":
        return None, RolloutDecision(False, "speculative.draft_rollout is off")
    reason = unsupported_reason(model, num_draft_tokens)
    if reason is not None:
        return None, RolloutDecision(False, reason)
    rollout, compile_s, failures = None, 0.0, []
    for attempt in (wrapper, "python") if wrapper == "cpp" else (wrapper,):
        rollout = DraftRollout(model, num_draft_tokens, attempt)
        rollout.always = mode == "on"
        try:
            compile_s = rollout.compile()
            break
        except Exception as exc:  # noqa: BLE001 - a compiler or inductor failure: say so, or fail start-up when asked
            failures.append(f"{attempt} wrapper: {type(exc).__name__}: {exc}")
            log.warning("draft rollout not compiled with the %s wrapper (%s)", attempt, exc)
            rollout = None
    if rollout is None:
        if mode == "on":
            raise RuntimeError("speculative.draft_rollout is on but compiling the rollout failed: "
                               + "; ".join(failures))
        log.warning("the draft proposes step by step")
        return None, RolloutDecision(False, f"compiling failed: {'; '.join(failures)}"[:300])
    wrapper = rollout.wrapper
    decision = RolloutDecision(True, f"speculative.draft_rollout is on ({wrapper} wrapper)", rollout.steps,
                               compile_s, wrapper=wrapper)
    if mode == "auto":
        rollout_s, eager_s = rollout.measure()
        decision.rollout_ms, decision.eager_ms = rollout_s * 1e3, eager_s * 1e3
        decision.enabled = rollout_s <= _TOLERANCE * eager_s
        decision.reason = (f"{rollout.steps} steps: compiled rollout {rollout_s * 1e3:.2f} ms ({wrapper} wrapper), "
                           f"eager forwards {eager_s * 1e3:.2f} ms")
    if failures:  # the C++ wrapper failed and the Python one compiled
        decision.reason += f" (the cpp wrapper failed: {failures[0]})"[:300]
    log.info("draft rollout %s (%s; compiled in %.1f s)", "on" if decision.enabled else "off", decision.reason,
             compile_s)
    return (rollout if decision.enabled else None), decision
