"""Grammar-constrained decoding in the engine: random JSON schemas, plain and speculative decoding."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr

from serving.engine.config import SpeculativeConfig
from serving.engine.engine import LLMEngine
from serving.engine.grammar import GrammarCompiler, GrammarError, GrammarSpec, RequestGrammar
from serving.engine.types import GenerationRequest, SamplingParams

WORDS = ["alpha", "beta", "gamma", "delta", "os", "sys", "path", "name", "value", "item"]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A random schema: nested objects, arrays, enums, bounded numbers, required and optional properties."""
    kinds = ["integer", "number", "string", "enum", "boolean"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds) if depth else "object"
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        low = rng.randint(-10, 10)
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 100)}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        schema: dict[str, Any] = {"type": "array", "items": random_schema(rng, depth + 1),
                                  "maxItems": rng.randint(1, 3)}
        if rng.random() < 0.5:
            schema["minItems"] = 1
        return schema
    names = rng.sample(WORDS, rng.randint(1, 4))
    return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names},
            "required": [n for n in names if rng.random() < 0.6], "additionalProperties": False}


def demo_target() -> Path | None:
    from serving.demo import draft_path, target_path

    ok = all((p / "model.safetensors").is_file() for p in (target_path(), draft_path()))
    return target_path() if ok else None


needs_demo = pytest.mark.skipif(demo_target() is None, reason="demo target/draft weights not present")

SPEC = {
    "off": None,
    "ngram": dict(method="ngram", num_draft_tokens=4, adaptive=False),
    "draft": dict(method="draft", num_draft_tokens=4, adaptive=False),
}


def demo_engine(kit: Any, spec: str) -> LLMEngine:
    from serving.demo import draft_path, target_path

    config = SPEC[spec]
    extra: dict[str, Any] = {"max_concurrency": 64, "max_batched_tokens": 512, "kv_cache_bytes": 64 * 2**20,
                             "max_queue": 1024}
    if config is not None:
        if config["method"] == "draft":
            config = {**config, "draft_model": str(draft_path())}
        extra["speculative"] = SpeculativeConfig(enabled=True, **config)
    return kit.make_engine(target_path(), **extra)


def generate(engine: LLMEngine, schemas: list[dict[str, Any]], sampled: bool, max_tokens: int = 400
             ) -> list[tuple[str, str | None]]:
    compiler = GrammarCompiler(engine.tokenizer, vocab_size=engine.args.vocab_size,
                               stop_token_ids=engine.args.eos_token_ids)
    prompt = engine.tokenizer("settings = json.loads(", add_special_tokens=False)["input_ids"]
    texts: dict[str, list[str]] = {}
    finish: dict[str, str | None] = {}
    for i, schema in enumerate(schemas):
        params = SamplingParams(temperature=0.9 if sampled else 0.0, seed=i, max_tokens=max_tokens)
        engine.add_request(GenerationRequest(str(i), prompt, params,
                                             grammar=compiler.compile(GrammarSpec.json_schema(schema))))
        texts[str(i)] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id].append(out.new_text)
            if out.finished:
                finish[out.request_id] = out.finish_reason
    return [("".join(texts[str(i)]), finish.get(str(i))) for i in range(len(schemas))]


def check_outputs(schemas: list[dict[str, Any]], outputs: list[tuple[str, str | None]]) -> None:
    for schema, (text, reason) in zip(schemas, outputs, strict=True):
        assert reason == "stop", f"did not close ({reason}): {text!r} for {json.dumps(schema)}"
        jsonschema.validate(json.loads(text), schema)


@needs_demo
@pytest.mark.parametrize("spec", list(SPEC))
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_outputs_validate_against_random_schemas(kit: Any, spec: str, sampled: bool) -> None:
    rng = random.Random(7)
    schemas = [random_schema(rng) for _ in range(8)]
    engine = demo_engine(kit, spec)
    check_outputs(schemas, generate(engine, schemas, sampled))
    if spec != "off":
        assert engine.stats().spec.num_drafts > 0  # the drafts really went through the grammar path


@pytest.mark.slow
@needs_demo
@pytest.mark.parametrize("spec", list(SPEC))
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_200_random_schemas_validate(kit: Any, spec: str, sampled: bool) -> None:
    rng = random.Random(2026)
    schemas = [random_schema(rng) for _ in range(200)]
    check_outputs(schemas, generate(demo_engine(kit, spec), schemas, sampled))


@needs_demo
def test_greedy_constrained_output_is_the_same_with_speculation_on_and_off(kit: Any) -> None:
    rng = random.Random(3)
    schemas = [random_schema(rng) for _ in range(6)]
    expected = generate(demo_engine(kit, "off"), schemas, sampled=False)
    assert generate(demo_engine(kit, "ngram"), schemas, sampled=False) == expected
    assert generate(demo_engine(kit, "draft"), schemas, sampled=False) == expected


# ---- the matcher and the compiler, on a vocabulary of single letters --------------------------------------

LETTERS = ["<eos>"] + [chr(ord("a") + i) for i in range(8)]


def letters_grammar(ebnf: str) -> xgr.CompiledGrammar:
    info = xgr.TokenizerInfo(LETTERS, vocab_size=len(LETTERS), stop_token_ids=[0])
    return xgr.GrammarCompiler(info).compile_grammar(ebnf)


def test_drafts_are_cut_at_the_first_rejected_token_and_after_the_end() -> None:
    grammar = RequestGrammar(letters_grammar('root ::= "a" "b" "c"'))
    assert grammar.admissible_drafts([1, 2, 5, 3]) == [1, 2]
    assert grammar.admissible_drafts([1, 2, 5, 3], sampled=True) == [1, 2, 5]  # rejected by rejection sampling
    assert grammar.admissible_drafts([1, 2, 3, 0]) == [1, 2, 3, 0]
    for sampled in (False, True):  # nothing after the stop token
        assert grammar.admissible_drafts([1, 2, 3, 0, 1, 2], sampled=sampled) == [1, 2, 3, 0]
    assert grammar.accept(1)  # the walks were rolled back: the matcher is still at the start


def test_the_compiler_caches_by_schema_and_names_bad_schemas(kit: Any) -> None:
    from transformers import AutoTokenizer

    from serving.demo import tokenizer_path

    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(str(tokenizer_path())))
    first = compiler.compile(GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}))
    again = compiler.compile(GrammarSpec.json_schema({"properties": {"a": {"type": "integer"}}, "type": "object"}))
    assert first is again and compiler.compilations == 1
    with pytest.raises(GrammarError, match='Unsupported type "frobnicate"'):
        compiler.compile(GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "frobnicate"}}}))
    with pytest.raises(GrammarError, match="must be an object"):
        GrammarSpec.json_schema(["not", "a", "schema"])


@needs_demo
@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_constrained_generation_with_speculation_writes_nothing_to_stderr(
    kit: Any, spec: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """A matcher fed after its stop token makes xgrammar print a warning to stderr (file descriptor 2, outside the
    structured log): no walk may do that (issue 37, 276 lines in one run)."""
    rng = random.Random(11)
    schemas = [random_schema(rng) for _ in range(8)]
    engine = demo_engine(kit, spec)
    capfd.readouterr()
    for sampled in (False, True):
        check_outputs(schemas, generate(engine, schemas, sampled))
    assert engine.stats().spec.num_drafts > 0
    assert capfd.readouterr().err == ""
