"""`specdeploy bench grammar`: tokens/s of JSON-schema-constrained decoding against unconstrained decoding on
the same engine, at each concurrency, measured back to back in one run (the goal: constrained >= 0.9x).

Every request generates exactly `output_len` tokens, greedy: unconstrained ones ignore EOS; constrained ones
follow a schema that cannot close sooner (an array of at least MIN_ITEMS small objects), so both sides do
the same number of steps and the ratio is the grammar's cost (the bitmask per row per step, the matcher
updates, and with speculation the draft walks and per-position verify masks). Compilation is cached and off
the engine loop in the server; here it is timed once, apart.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from serving.engine.config import EngineConfig, SpeculativeConfig
from serving.engine.engine import LLMEngine
from serving.engine.grammar import ENGINE_TIME, GrammarCompiler, GrammarSpec
from serving.engine.types import GenerationRequest, SamplingParams

MIN_ITEMS = 64
SCHEMA: dict[str, Any] = {
    "type": "array", "minItems": MIN_ITEMS,
    "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "size": {"type": "integer", "minimum": 0, "maximum": 100000},
                                               "kind": {"enum": ["file", "dir", "link"]}},
              "required": ["name", "size", "kind"], "additionalProperties": False},
}
PROMPT_TEXT = "entries = json.loads("


@dataclass
class GrammarBenchReport:
    model: str
    speculative: str
    output_len: int
    threads: int
    repeats: int
    compile_s: float
    tokens_per_s: dict[str, dict[int, float]] = field(default_factory=dict)  # mode -> concurrency -> best tok/s
    # concurrency -> share of the constrained runs' wall time spent in grammar work (masks, matcher walks):
    # 1 - share is the ratio the grammar alone allows, steadier than two tok/s figures on a loaded machine
    grammar_share: dict[int, float] = field(default_factory=dict)

    def ratio(self, concurrency: int) -> float:
        return self.tokens_per_s["constrained"][concurrency] / self.tokens_per_s["unconstrained"][concurrency]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["constrained_over_unconstrained"] = {c: round(self.ratio(c), 4)
                                                 for c in self.tokens_per_s["unconstrained"]}
        out["ratio_implied_by_grammar_share"] = {c: round(1 - s, 4) for c, s in self.grammar_share.items()}
        return out


def _run(engine: LLMEngine, prompt: list[int], concurrency: int, output_len: int, grammar: Any | None,
         shares: list[float] | None = None) -> float:
    """c requests at once, each exactly output_len tokens; generated tokens per second of wall time (and, into
    shares, the fraction of it spent in grammar work)."""
    grammar_before = ENGINE_TIME.seconds
    for i in range(concurrency):
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=grammar is None)
        engine.add_request(GenerationRequest(f"r{i}", prompt, params, grammar=grammar))
    generated = 0
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            generated += len(out.new_token_ids)
            if out.finished and grammar is not None and out.finish_reason != "length":
                raise RuntimeError(f"a constrained request ended early ({out.finish_reason}); raise MIN_ITEMS")
    wall = time.perf_counter() - started
    if shares is not None:
        shares.append((ENGINE_TIME.seconds - grammar_before) / wall)
    return generated / wall


def run_grammar_benchmark(model_dir: Path, concurrencies: list[int], output_len: int = 128, threads: int | str = "auto",
                          device: str = "cpu", repeats: int = 2, speculative: str = "off",
                          draft_dir: Path | None = None) -> GrammarBenchReport:
    spec = SpeculativeConfig()
    if speculative == "ngram":
        spec = SpeculativeConfig(enabled=True, method="ngram")
    elif speculative == "draft":
        spec = SpeculativeConfig(enabled=True, method="draft", draft_model=str(draft_dir))
    engine = LLMEngine.from_config(EngineConfig(
        model=str(model_dir), device=device, num_threads=threads, speculative=spec,
        max_concurrency=max(concurrencies), max_batched_tokens=max(512, max(concurrencies) * 2)))
    if engine.tokenizer is None:
        raise ValueError(f"{model_dir} has no tokenizer: constrained decoding needs one")
    compiler = GrammarCompiler(engine.tokenizer, vocab_size=engine.args.vocab_size,
                               stop_token_ids=engine.args.eos_token_ids)
    started = time.perf_counter()
    grammar = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    compile_s = time.perf_counter() - started
    prompt = list(engine.tokenizer(PROMPT_TEXT, add_special_tokens=False)["input_ids"])
    report = GrammarBenchReport(str(model_dir), speculative, output_len, torch.get_num_threads(), repeats,
                                round(compile_s, 4),
                                {"unconstrained": {}, "constrained": {}})
    with torch.inference_mode():
        _run(engine, prompt, 1, 8, None)  # warm-up
        _run(engine, prompt, 1, 8, grammar)
        for c in concurrencies:
            _run(engine, prompt, c, 8, None)  # this batch size's first steps (allocations) count for neither
            _run(engine, prompt, c, 8, grammar)
            sides = [("unconstrained", None), ("constrained", grammar)]
            shares: list[float] = []
            for r in range(repeats):  # interleaved, alternating who goes first: a shared machine's drifts hit both
                for mode, g in sides if r % 2 == 0 else sides[::-1]:
                    rate = _run(engine, prompt, c, output_len, g, shares if g is not None else None)
                    report.tokens_per_s[mode][c] = round(max(rate, report.tokens_per_s[mode].get(c, 0.0)), 2)
            report.grammar_share[c] = round(min(shares), 4)
    return report
