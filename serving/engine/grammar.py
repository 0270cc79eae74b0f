"""Grammar-constrained decoding (structured outputs, forced tool calls) with xgrammar.

    API (worker thread)      GrammarCompiler.compile(spec) → CompiledGrammar, cached by spec (schema text)
    engine, per request      RequestGrammar: an xgrammar matcher over the tokens generated so far
    plain sampling           apply_grammar_masks: each grammar row's logits outside the allowed tokens → -inf
    speculative decoding     admissible_drafts: drafts cut where the grammar rejects them (see below);
                             mask_verify_rows: the verify row at draft position j masked with the matcher
                             advanced through drafts 0..j-1, then rolled back

Drafts and losslessness. Drafts are cut *before* the first token the grammar rejects where verification is
coupled (spec/rejection.py: seeded and greedy requests, n-gram drafts): it emits the masked target's own token at
every position, never one the grammar rejects, so such a draft could only be rejected. A model's drafts verified
by rejection sampling (unseeded sampled requests) keep that first rejected token as their last one: the masked
target gives it probability 0, so it is rejected and the residual max(0, p - q) sampled, the ordinary lossless
rule; cutting before it would sample p there instead of the residual and bias the output toward what the draft
rarely proposes. Either way nothing is kept after a draft that ends the grammar.

The matcher only ever holds the tokens the request really emitted: drafts walked through it are rolled back
at once, and `Request.append_output_tokens` accepts what verification emitted. A terminated matcher (its stop
token accepted) is never fed another token: `RequestGrammar.accept` refuses it without calling xgrammar, which
would print a warning to stderr, outside the structured log.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import xgrammar as xgr

GrammarKind = Literal["json_object", "json_schema", "tool_call"]
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"  # the Hermes / Qwen convention
_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+?:\d+: ")  # "[05:05:28] /project/cpp/file.cc:94: " in xgrammar errors


class _Clock:
    """Seconds the engine thread spent on grammar work (masks, matcher walks): `bench grammar` reports it."""

    seconds = 0.0


ENGINE_TIME = _Clock()


class GrammarError(ValueError):
    """The grammar (a JSON schema) cannot be compiled; the message names the problem."""


@dataclass(frozen=True)
class GrammarSpec:
    """What to constrain the output to: any JSON object, JSON valid against a schema (canonical text), or one
    tool call, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, whose JSON follows the schema."""

    kind: GrammarKind
    schema: str | None = None

    @classmethod
    def json_schema(cls, schema: Any) -> GrammarSpec:
        if not isinstance(schema, dict):
            raise GrammarError(f"the JSON schema must be an object, got {type(schema).__name__}")
        return cls("json_schema", _canonical(schema))

    @classmethod
    def tool_call(cls, functions: dict[str, dict[str, Any] | None]) -> GrammarSpec:
        """One call of one of `functions` (name -> its parameters' JSON schema; None: any object)."""
        if not functions:
            raise GrammarError("a tool call grammar needs at least one function")
        # the name before the arguments (xgrammar writes properties in the schema's order), so a stream can say
        # which function is called before its arguments come (serving/api/render/tool_calls.py); each schema canonical
        calls = [{"type": "object", "properties": {"name": {"const": name},
                                                    "arguments": json.loads(_canonical(params or {"type": "object"}))},
                  "required": ["name", "arguments"]} for name, params in sorted(functions.items())]
        return cls("tool_call", json.dumps(calls[0] if len(calls) == 1 else {"anyOf": calls}, separators=(",", ":")))


def _canonical(schema: Any) -> str:
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


class GrammarCompiler:
    """Compiles grammars for one tokenizer; thread-safe, with an LRU cache keyed by the spec."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, stop_token_ids: Sequence[int] | None = None,
                 cache_size: int = 256) -> None:
        stops = list(stop_token_ids) if stop_token_ids is not None else None
        if stops is None and getattr(tokenizer, "eos_token_id", None) is not None:
            stops = [int(tokenizer.eos_token_id)]
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compilations = 0  # cache misses (tests and metrics)

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                return cached
        compiled = self._compile(spec)  # outside the lock: two threads may compile the same spec once each
        with self._lock:
            self.compilations += 1
            self._cache[spec] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        try:
            if spec.kind == "json_object":
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            assert spec.schema is not None
            if spec.kind == "tool_call":
                call = xgr.Grammar.from_json_schema(spec.schema, any_whitespace=False, strict_mode=True)
                return self._compiler.compile_grammar(xgr.Grammar.concat(
                    xgr.Grammar.from_ebnf(f'root ::= "{TOOL_CALL_OPEN}"'), call,
                    xgr.Grammar.from_ebnf(f'root ::= "{TOOL_CALL_CLOSE}"')))
            return self._compiler.compile_json_schema(spec.schema, any_whitespace=False, strict_mode=True)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(f"unsupported or invalid JSON schema: {_NATIVE_PREFIX.sub('', str(exc)).strip()}") \
                from exc


_compilers: dict[int, tuple[Any, GrammarCompiler]] = {}
_compilers_lock = threading.Lock()


def compiler_for(tokenizer: Any) -> GrammarCompiler:
    """The one compiler (and cache) of a tokenizer object."""
    with _compilers_lock:
        entry = _compilers.get(id(tokenizer))
        if entry is None or entry[0] is not tokenizer:
            entry = (tokenizer, GrammarCompiler(tokenizer))
            _compilers[id(tokenizer)] = entry
        return entry[1]


class RequestGrammar:
    """One request's matcher: the grammar state after the tokens it generated so far."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)  # rollback is unbounded in xgrammar >= 0.1.30
        self.vocab_size: int = compiled.tokenizer_info.vocab_size

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def accept(self, token: int) -> bool:
        """Advance the matcher by token; False (the matcher unchanged) when the grammar rejects it or has ended."""
        started = time.perf_counter()
        ok = 0 <= token < self.vocab_size and not self.is_terminated and bool(self.matcher.accept_token(token))
        ENGINE_TIME.seconds += time.perf_counter() - started
        return ok

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def admissible_drafts(self, drafts: list[int], *, sampled: bool = False) -> list[int]:
        """The drafts cut at the first one the grammar rejects (kept as the last one when `sampled`), and after one
        that ends it."""
        accepted, ended = 0, False
        for token in drafts:
            if self.is_terminated:
                ended = True
                break
            if not self.accept(token):
                break
            accepted += 1
        self.rollback(accepted)
        return drafts[: accepted + 1] if sampled and not ended and accepted < len(drafts) else drafts[:accepted]


def _mask_rows(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
    """In place: rows of logits [N, V] outside bitmask's allowed tokens (and past the grammar's vocab) → -inf."""
    index = torch.tensor(rows, dtype=torch.long)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=min(vocab_size, logits.shape[-1]),
                                    indices=rows)
    if logits.shape[-1] > vocab_size:  # model ids the tokenizer does not have are never grammatical
        logits[index.to(logits.device), vocab_size:] = float("-inf")


def apply_grammar_masks(logits: torch.Tensor, grammars: Sequence[RequestGrammar | None]) -> torch.Tensor:
    """logits [N, V], one grammar (or None) per row; returns logits itself when no row has a grammar, else a
    masked copy (the input is never modified: logprobs are computed from the raw logits)."""
    rows = [i for i, g in enumerate(grammars) if g is not None and not g.is_terminated]
    if not rows:
        return logits
    started = time.perf_counter()
    out = logits.clone()
    vocab = max(g.vocab_size for g in grammars if g is not None)
    bitmask = xgr.allocate_token_bitmask(len(grammars), vocab)
    for i in rows:
        grammar = grammars[i]
        assert grammar is not None
        grammar.fill(bitmask, i)
    _mask_rows(out, bitmask, rows, vocab)
    ENGINE_TIME.seconds += time.perf_counter() - started
    return out


def mask_verify_rows(
    logits: torch.Tensor, grammars: Sequence[RequestGrammar | None], drafts: Sequence[list[int]]
) -> None:
    """In place: request i owns len(drafts[i]) + 1 consecutive rows of logits; its row j is masked with its
    matcher advanced through drafts[i][:j]. Rows after a draft the grammar rejects, or after one that ends it,
    are left as they are: verification never emits past them (the request stops at the grammar's end)."""
    if all(g is None for g in grammars):
        return
    started = time.perf_counter()
    vocab = max(g.vocab_size for g in grammars if g is not None)
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], vocab)
    rows: list[int] = []
    start = 0
    for grammar, draft in zip(grammars, drafts, strict=True):
        if grammar is not None:
            accepted = 0
            for j in range(len(draft) + 1):
                if grammar.is_terminated:
                    break
                grammar.fill(bitmask, start + j)
                rows.append(start + j)
                if j == len(draft) or not grammar.accept(draft[j]):
                    break
                accepted += 1
            grammar.rollback(accepted)
        start += len(draft) + 1
    if rows:
        _mask_rows(logits, bitmask, rows, vocab)
    ENGINE_TIME.seconds += time.perf_counter() - started
