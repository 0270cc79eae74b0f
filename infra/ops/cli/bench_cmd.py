"""`specdeploy bench engine`: our engine's throughput against transformers, printed as JSON and a table.

`bench server` (HTTP vs engine) is registered here too, from the server's own bench_server module.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, get_args

from infra.ops.cli.main import CommandError
from serving.config import Dtype

# model.cpu_weight_packing of every engine a bench builds (serving.engine.kernels.cpu_linear)
_PACKING_ARG: dict[str, Any] = {
    "choices": ("auto", "on", "off"), "default": "auto",  # serving.config.WeightPacking (not imported at start-up)
    "help": "model.cpu_weight_packing of every engine measured (auto: per model, packed for oneDNN where a one-token "
            "step measured no slower at start-up; the JSON lists the decisions)",
}

# model.cpu_decode_attention of every engine a bench builds (serving.engine.kernels.cpu_attention)
_ATTENTION_ARG: dict[str, Any] = {
    "choices": ("auto", "on", "off"), "default": "auto",  # serving.config.DecodeAttentionMode
    "help": "model.cpu_decode_attention of every engine measured (auto: per model, decode attention through the C++ "
            "kernel reading the paged cache in place where it measured faster at start-up; the JSON lists the "
            "decisions)",
}


def threads(text: str) -> int | str:
    """--threads: a count, or auto (the engine decides at start-up, as a server with model.num_threads auto)."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a thread count (a positive integer) or 'auto'")
    return value


# --threads of every bench: the server's model.num_threads
THREADS_ARG: dict[str, Any] = {
    "type": threads, "default": "auto",
    "help": "model.num_threads of every engine measured (default auto, as the server: one core kept for the server, "
            "the rest measured at start-up; the report lists the decision)",
}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("bench", help="benchmark the serving engine")
    actions = parser.add_subparsers(dest="bench_command", metavar="BENCH", required=True)

    engine = actions.add_parser(
        "engine",
        help="tokens/s of the engine at several concurrencies vs transformers generate / generate_batch",
        description="One run on fixed prompts with a fixed output length (EOS ignored, greedy). "
        "Default model: the bundled demo target.",
    )
    engine.add_argument("--model", type=Path, help="model directory (default: the demo target)")
    engine.add_argument("--concurrency", default="1,4,16,32", help="comma-separated list (default 1,4,16,32)")
    engine.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    engine.add_argument("--threads", **THREADS_ARG)
    engine.add_argument("--device", default="cpu", help="cpu or cuda")
    engine.add_argument("--no-baselines", action="store_true", help="skip the transformers baselines")
    engine.add_argument("--profile", action="store_true", help="append a torch.profiler op table")
    engine.add_argument("--repeats", type=int, default=2,
                        help="rounds over every system and concurrency, back to back; the best counts (default 2)")
    engine.add_argument("--json-out", type=Path, help="also write the JSON report to this file")
    engine.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                        help="model.compile for the engine (auto: compiled small steps on CUDA only; on: also on "
                             "CPU, each bucket kept only where it beat eager at warm-up; the report lists them)")
    engine.add_argument("--cpu-weight-packing", **_PACKING_ARG)
    engine.add_argument("--cpu-decode-attention", **_ATTENTION_ARG)
    engine.add_argument("--dtype", choices=get_args(Dtype), default="auto",
                        help="weight and activation precision of the engine and the baselines (auto: fp32 on CPU)")
    engine.add_argument("--quantization", choices=("int8", "fp8"),
                        help="instead: the quantized engine beside the unquantized one (held-out perplexity, "
                             "weight bytes, tokens/s at each concurrency); fp8 needs a GPU of capability >= 8.9")
    engine.set_defaults(func=_bench_engine)

    spec = actions.add_parser(
        "spec",
        help="speculative decoding: c=1 latency/tokens/s (off, draft, n-gram, transformers assisted/lookup) and "
             "spec-on / spec-off throughput across concurrency",
        description="One run, greedy, fixed output length, held-out demo code prompts. Default pair: the demo "
        "target and draft.",
    )
    spec.add_argument("--target", type=Path, help="target model directory (default: the demo target)")
    spec.add_argument("--draft", type=Path, help="draft model directory (default: the demo draft)")
    spec.add_argument("--concurrency", default="1,4,16,64", help="comma-separated list (default 1,4,16,64)")
    spec.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    spec.add_argument("--prompts", type=int, default=8, help="held-out code prompts used (default 8)")
    spec.add_argument("--k", type=int,
                      help="speculative.num_draft_tokens: the most draft tokens a step (default: the server's)")
    spec.add_argument("--threads", **THREADS_ARG)
    spec.add_argument("--no-baselines", action="store_true", help="skip transformers assisted generation")
    spec.add_argument("--repeats", type=int, default=2,
                      help="c=1: passes over the prompts, every prompt on each system back to back (all "
                           "requests count); throughput: runs per system and concurrency, interleaved, the best "
                           "counts (default 2)")
    spec.add_argument("--json-out", type=Path, help="also write the JSON report to this file")
    spec.add_argument("--trace-policy", type=Path, metavar="FILE",
                      help="also write every choice of the adaptive policy (draft and n-gram engines) to FILE as "
                           "JSON lines: phase, candidates, fitted costs, acceptance estimates, catch-up, k chosen")
    spec.add_argument("--cpu-weight-packing", **_PACKING_ARG)
    spec.add_argument("--cpu-decode-attention", **_ATTENTION_ARG)
    spec.add_argument("--draft-rollout", choices=("auto", "on", "off"), default="auto",
                      help="speculative.draft_rollout of the draft engine (auto: the draft's catch-up and drafts as "
                           "one compiled graph on CPU where the start-up measurement finds it faster)")
    spec.add_argument("--draft-token-map", metavar="NAME", default="auto",
                      help="speculative.draft_token_map of the draft engine: a token map file in the draft's "
                           "directory, 'auto' (default, as the server: the draft's token_map.json where it ships one) "
                           "or 'none'")
    spec.add_argument("--draft-rollout-wrapper", choices=("cpp", "python"), default="cpp",
                      help="speculative.draft_rollout_wrapper: what calls the rollout's compiled kernels (cpp: "
                           "inductor's C++ wrapper, ~40 s to compile the first time on a host; python: ~4 s)")
    spec.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                      help="model.compile for every engine measured (on: the target's and the draft's small steps "
                           "compiled on CPU too, each bucket kept only where it beat eager at warm-up)")
    spec.add_argument("--no-adaptive", action="store_true",
                      help="draft k tokens at every speculating step instead of letting the policy choose 0..k")
    spec.add_argument("--dtype", choices=get_args(Dtype), default="auto",
                      help="precision of every engine and baseline measured (auto: fp32 on CPU)")
    spec.set_defaults(func=_bench_spec)

    prefix = actions.add_parser(
        "prefix",
        help="TTFT of requests sharing a long system prompt, prefix caching on vs off",
        description="One run: the same requests (a shared system prompt plus each request's own held-out code "
        "turn, greedy, EOS ignored) through an engine with prefix caching and one without, in a closed loop. "
        "Default model: the demo target.",
    )
    prefix.add_argument("--model", type=Path, help="model directory (default: the demo target)")
    prefix.add_argument("--system-tokens", type=int, default=1024, help="shared system prompt length (default 1024)")
    prefix.add_argument("--requests", type=int, default=16, help="requests per engine (default 16)")
    prefix.add_argument("--concurrency", type=int, default=1, help="requests in flight (default 1)")
    prefix.add_argument("--output-len", type=int, default=32, help="tokens generated per request (default 32)")
    prefix.add_argument("--threads", **THREADS_ARG)
    prefix.add_argument("--device", default="cpu", help="cpu or cuda")
    prefix.add_argument("--cpu-weight-packing", **_PACKING_ARG)
    prefix.add_argument("--cpu-decode-attention", **_ATTENTION_ARG)
    prefix.add_argument("--json-out", type=Path, help="also write the JSON report to this file")
    prefix.set_defaults(func=_bench_prefix)

    grammar = actions.add_parser(
        "grammar",
        help="structured outputs: tokens/s of JSON-schema-constrained vs unconstrained decoding (goal >= 0.9x)",
        description="One run, greedy, exactly --output-len tokens per request on both sides (a schema that cannot "
        "close sooner), measured back to back on one engine. Default model: the demo target.",
    )
    grammar.add_argument("--model", type=Path, help="model directory (default: the demo target)")
    grammar.add_argument("--concurrency", default="1,16", help="comma-separated list (default 1,16)")
    grammar.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    grammar.add_argument("--speculative", choices=("off", "ngram", "draft"), default="off",
                         help="speculative decoding on both sides (draft: the demo draft, or --draft)")
    grammar.add_argument("--draft", type=Path, help="draft model directory (default: the demo draft)")
    grammar.add_argument("--threads", **THREADS_ARG)
    grammar.add_argument("--device", default="cpu", help="cpu or cuda")
    grammar.add_argument("--repeats", type=int, default=2, help="interleaved runs per side; the best counts")
    grammar.add_argument("--json-out", type=Path, help="also write the JSON report to this file")
    grammar.set_defaults(func=_bench_grammar)

    http = actions.add_parser(
        "http",
        help="speculation on ÷ off through HTTP from the plain server config (c=1 speed-up, P99, greedy identity, "
             "c>1 ratios); --matrix: the load-safety matrix (k x token map x dtype x proposer x concurrency)",
        description="Servers started with `specdeploy serve` and a config naming only the model paths (plus a "
                    "port and a long request timeout): every other key at its default, no thread variables. "
                    "Held-out code prompts, greedy, EOS ignored. Default pair: the demo target and draft.",
    )
    http.add_argument("--target", type=Path, help="target model directory (default: the demo target)")
    http.add_argument("--draft", type=Path, help="draft model directory (default: the demo draft)")
    http.add_argument("--matrix", action="store_true",
                      help="the load-safety matrix instead of the plain config's run")
    http.add_argument("--concurrency", help="comma-separated list (default 1,16,64; with --matrix 4,16,64)")
    http.add_argument("--output-len", type=int, default=96, help="tokens generated per request (default 96)")
    http.add_argument("--prompts", type=int, default=8, help="held-out code prompts (default 8)")
    http.add_argument("--repeats", type=int, default=4,
                      help="c=1: rounds over the prompts; c>1: rounds of an off and an on closed-loop phase, pooled "
                           "(default 4)")
    http.add_argument("--dtypes", default="fp32,bf16", help="--matrix: model.dtype values (default fp32,bf16)")
    http.add_argument("--ks", default="4,8,12", help="--matrix: speculative.num_draft_tokens values (default 4,8,12)")
    http.add_argument("--only", action="append", default=[], metavar="TEXT",
                      help="--matrix: only the rows whose name contains TEXT (repeatable), e.g. "
                           "--only 'draft k=12 map=none dtype=fp32'")
    http.add_argument("--threads-check", action="store_true",
                      help="also spec-off c=1 with every explicit model.num_threads 1..cores against auto")
    http.add_argument("--workdir", type=Path, help="keep the servers' configs and logs here (default: a temp dir)")
    http.add_argument("--json-out", type=Path, help="also write the JSON report to this file")
    http.set_defaults(func=_bench_http)
    try:  # `bench server` (HTTP vs engine) belongs to the server and lives beside this module
        from infra.ops.cli.bench_server import register_server
    except ImportError:
        return
    register_server(actions)


def _model_dir(arg: Path | None, which: str = "target") -> Path:
    if arg is not None:
        path = arg
    else:
        from serving.demo import draft_path, target_path

        path = target_path() if which == "target" else draft_path()
    if not (path / "config.json").is_file():
        flag = {"target": "--model/--target", "draft": "--draft"}[which]
        raise CommandError(f"no {which} model at {path} (config.json missing); pass {flag} DIR")
    return path


def _concurrencies(text: str) -> list[int]:
    try:
        concurrencies = sorted({int(c) for c in text.split(",") if c.strip()})
    except ValueError as exc:
        raise CommandError(f"--concurrency must be integers separated by commas: {exc}") from exc
    if not concurrencies or min(concurrencies) < 1:
        raise CommandError("--concurrency needs at least one positive integer")
    return concurrencies


def _as_a_server(device: str) -> None:
    """Before torch loads: what a server's entry point decides for its process (model.cpu_huge_pages at its
    default), so that the engines measured in this process run as a plain server's does. Their start-up
    decisions, printed with the figures, state it."""
    from serving.engine import huge_pages

    huge_pages.apply("auto", device)


def _bench_engine(args: argparse.Namespace) -> int:
    _as_a_server(args.device)
    if args.quantization:
        return _bench_quantization(args)
    from infra.bench.engine import run_engine_benchmark

    concurrencies = _concurrencies(args.concurrency)
    report = run_engine_benchmark(_model_dir(args.model), concurrencies, args.output_len, args.threads,
                                  baselines=not args.no_baselines, profile=args.profile, device=args.device,
                                  repeats=args.repeats, compile_mode=args.compile, dtype=args.dtype,
                                  weight_packing=args.cpu_weight_packing,
                                  decode_attention=args.cpu_decode_attention)
    data = report.to_dict()
    profile = data.pop("profile")
    text = json.dumps(data, indent=2)
    sys.stdout.write(text + "\n")
    if args.json_out:
        args.json_out.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    _print_table(report, concurrencies)
    if profile:
        sys.stdout.write("\n" + profile + "\n")
    return 0


def _bench_quantization(args: argparse.Namespace) -> int:
    import torch

    from serving.engine.quant import QuantizationUnsupported, check_supported

    try:
        check_supported(args.quantization, torch.device(args.device))
    except QuantizationUnsupported as exc:
        raise CommandError(str(exc)) from exc
    if args.device != "cpu":
        raise CommandError("--quantization is measured on --device cpu here (fp32 beside the quantized engine)")
    from infra.bench.quant import run_quant_benchmark

    concurrencies = _concurrencies(args.concurrency)
    report = run_quant_benchmark(_model_dir(args.model), args.quantization, concurrencies, args.output_len,
                                 args.threads, repeats=args.repeats)
    text = json.dumps(report.to_dict(), indent=2)
    sys.stdout.write(text + "\n")
    if args.json_out:
        args.json_out.write_text(text + "\n")
    q = args.quantization
    lines = [f"{'c':>4}  {'fp32 tok/s':>11}  {q + ' tok/s':>11}  {q + '/fp32':>9}"]
    for c in concurrencies:
        base, quant = report.tokens_per_s["none"][c], report.tokens_per_s[q][c]
        lines.append(f"{c:>4}  {base:>11,.1f}  {quant:>11,.1f}  {quant / base:>9.2f}")
    if report.perplexity:
        ppl = report.perplexity
        lines.append(f"held-out perplexity over {report.heldout_tokens:,} tokens: fp32 {ppl['none']:.3f}, "
                     f"{q} {report.perplexity[q]:.3f} ({report.perplexity_relative_gap:+.2%}; goal within 2%)")
    lines.append(f"weight bytes: fp32 {report.weight_bytes['none']:,}, {q} {report.weight_bytes[q]:,} "
                 f"({report.weight_ratio:.3f}x; goal <= 0.3)")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def _bench_spec(args: argparse.Namespace) -> int:
    _as_a_server("auto")
    from infra.bench.spec import run_spec_benchmark

    if args.trace_policy is not None and not args.trace_policy.parent.is_dir():
        raise CommandError(f"--trace-policy {args.trace_policy}: directory {args.trace_policy.parent} does not exist")
    trace: list[dict[str, Any]] | None = [] if args.trace_policy is not None else None
    token_map = None if args.draft_token_map == "none" else args.draft_token_map
    report = run_spec_benchmark(_model_dir(args.target), _model_dir(args.draft, "draft"),
                                _concurrencies(args.concurrency), args.output_len, args.prompts, args.k,
                                args.threads, baselines=not args.no_baselines, repeats=max(args.repeats, 1),
                                compile_mode=args.compile, adaptive=not args.no_adaptive, dtype=args.dtype,
                                weight_packing=args.cpu_weight_packing, draft_rollout=args.draft_rollout,
                                rollout_wrapper=args.draft_rollout_wrapper, decode_attention=args.cpu_decode_attention,
                                policy_trace=trace, draft_token_map=token_map)
    text = json.dumps(report.to_dict(), indent=2)
    sys.stdout.write(text + "\n")
    if args.json_out:
        args.json_out.write_text(text + "\n")
    if args.trace_policy is not None and trace is not None:
        partial = args.trace_policy.with_name(args.trace_policy.name + ".partial")
        partial.write_text("".join(json.dumps(record) + "\n" for record in trace))
        partial.replace(args.trace_policy)  # whole or not at all
        sys.stderr.write(f"policy trace: {len(trace)} choices in {args.trace_policy}\n")
    _print_spec_tables(report)
    return 0


def _bench_http(args: argparse.Namespace) -> int:
    import logging

    from infra.bench import http

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    concurrency = _concurrencies(args.concurrency or ("4,16,64" if args.matrix else "1,16,64"))
    target, draft = _model_dir(args.target).resolve(), _model_dir(args.draft, "draft").resolve()

    def say(line: str) -> None:
        sys.stderr.write(line + "\n")

    with http.scratch_dir(args.workdir) as workdir:
        if args.matrix:
            report = http.run_matrix(target, draft, concurrency, args.output_len, args.prompts,
                                     max(args.repeats, 1), [d for d in args.dtypes.split(",") if d],
                                     _concurrencies(args.ks), Path(workdir), say, args.only)
        else:
            report = http.run_plain(target, draft, concurrency, args.output_len, args.prompts,
                                    max(args.repeats, 1), args.threads_check, Path(workdir), say)
    text = http.dumps(report)
    sys.stdout.write(text + "\n")
    if args.json_out:
        args.json_out.write_text(text + "\n")
    _print_http_table(report)
    return 0


def _print_http_table(report: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    from infra.bench.http import GOALS, summary

    console = Console(stderr=True, width=200)
    console.print(f"server config of every run (plus the row's keys): {json.dumps(report.base_config)}")
    for dtype, line in report.off_decisions.items():
        console.print(f"spec-off server ({dtype}) start-up decisions: {line}")
    table = Table(title=f"spec on ÷ off through HTTP — {report.output_len} tokens, {report.prompts} held-out "
                        f"code prompts, greedy, {report.repeats} rounds")
    for column in ("configuration", "c", "off tok/s", "on tok/s", "on ÷ off", "90 % interval", "whole phases on ÷ off",
                   "P99 on ÷ off", "greedy identical"):
        table.add_column(column)
    for result in report.results:
        for pair in result.pairs:
            identical = f"{pair.identical}/{pair.compared}" if pair.compared is not None else ""
            flag = "" if result.control or pair.concurrency == 1 or pair.ratio >= GOALS["loaded_ratio"] \
                else " (below 0.97)"
            whole = f"{pair.phase_ratio:.3f}" if pair.phase_ratio is not None else ""
            interval = pair.interval
            spread = f"{interval[0]:.3f}-{interval[1]:.3f}" if interval is not None else ""
            table.add_row(result.variant.name, str(pair.concurrency), f"{pair.off_tokens_per_s:.1f}",
                          f"{pair.on_tokens_per_s:.1f}", f"{pair.ratio:.3f}{flag}", spread, whole,
                          f"{pair.p99_ratio:.3f}", identical)
    console.print(table)
    console.print("c > 1: tokens/s while every worker had a request to send (the phases' drains left out), pooled "
                  "over the rounds; '90 % interval': of on ÷ off, from the rounds' paired ratios; 'whole phases': the "
                  "same phases start to end; 'control': a spec-off server measured as a row, what the method reads "
                  "where nothing differs")
    for result in report.results:
        console.print(f"[{result.variant.name}] start-up decisions: {result.decisions}")
    console.print(f"summary: {json.dumps(summary(report))}  goals: {json.dumps(GOALS)}")


def _bench_grammar(args: argparse.Namespace) -> int:
    _as_a_server(args.device)
    from infra.bench.grammar import run_grammar_benchmark

    if args.output_len < 1 or args.repeats < 1:
        raise CommandError("--output-len and --repeats must be positive integers")
    draft = _model_dir(args.draft, "draft") if args.speculative == "draft" else None
    concurrencies = _concurrencies(args.concurrency)
    report = run_grammar_benchmark(_model_dir(args.model), concurrencies, args.output_len, args.threads,
                                   args.device, args.repeats, args.speculative, draft)
    text = json.dumps(report.to_dict(), indent=2)
    sys.stdout.write(text + "\n")
    if args.json_out:
        args.json_out.write_text(text + "\n")
    lines = [f"speculative decoding: {report.speculative}; schema compiled once in {report.compile_s * 1000:.1f} ms",
             f"{'c':>4}  {'unconstrained tok/s':>20}  {'constrained tok/s':>18}  {'ratio':>6}  "
             f"{'grammar share':>13}  {'1 - share':>9}"]
    for c in concurrencies:
        lines.append(f"{c:>4}  {report.tokens_per_s['unconstrained'][c]:>20,.1f}  "
                     f"{report.tokens_per_s['constrained'][c]:>18,.1f}  {report.ratio(c):>6.2f}  "
                     f"{report.grammar_share[c]:>13.1%}  {1 - report.grammar_share[c]:>9.3f}")
    lines.append("goal: ratio >= 0.90 at every concurrency (grammar share: the constrained runs' wall time spent "
                 "on masks and matcher walks; on a loaded machine 1 - share is the steadier figure)")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def _bench_prefix(args: argparse.Namespace) -> int:
    _as_a_server(args.device)
    from infra.bench.prefix import run_prefix_benchmark

    for flag in ("system_tokens", "requests", "concurrency", "output_len"):
        if getattr(args, flag) < 1:
            raise CommandError(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}")
    report = run_prefix_benchmark(_model_dir(args.model), args.requests, args.concurrency, args.system_tokens,
                                  args.output_len, args.threads, args.device, args.cpu_weight_packing,
                                  args.cpu_decode_attention)
    text = json.dumps(report.to_dict(), indent=2)
    sys.stdout.write(text + "\n")
    if args.json_out:
        args.json_out.write_text(text + "\n")
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{report.requests} requests, {report.system_prompt_tokens}-token shared system prompt, "
                        f"c={report.concurrency}, {report.output_len} tokens each, greedy")
    for col in ("prefix caching", "TTFT P50 ms", "TTFT P99 ms", "E2E P50 ms", "prompt tokens computed", "hit rate"):
        table.add_column(col, justify="left" if col == "prefix caching" else "right")
    for r in report.runs:
        table.add_row("on" if r.prefix_caching else "off", f"{r.ttft_p50_s * 1e3:.1f}", f"{r.ttft_p99_s * 1e3:.1f}",
                      f"{r.e2e_p50_s * 1e3:.1f}", f"{r.prompt_tokens_computed:,}", f"{r.prefix_cache_hit_rate:.2f}")
    console = Console(file=sys.stdout, width=120)
    console.print(table)
    console.print(f"TTFT P50 on / off: {report.ttft_p50_on_over_off:.3f} (goal <= 0.333)")
    console.print(f"greedy outputs identical with prefix caching on and off: {report.outputs_identical}")
    return 0


def _print_spec_tables(report: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout, width=120)
    for name, decisions in report.decisions.items():
        _print_decisions(console, name, decisions)
    c1 = Table(title=f"c=1, {report.prompts} held-out code prompts x {report.c1_rounds} interleaved rounds, "
                     f"{report.output_len} tokens each, greedy, k <= {report.num_draft_tokens}")
    for col in ("system", "tokens/s", "P50 s", "P99 s", "acceptance", "mean accepted length"):
        c1.add_column(col, justify="left" if col == "system" else "right")
    for r in report.c1:
        c1.add_row(r.system, "failed" if r.note else f"{r.tokens_per_s:,.1f}", f"{r.p50_latency_s:.2f}",
                   f"{r.p99_latency_s:.2f}", "" if r.acceptance_rate is None else f"{r.acceptance_rate:.2f}",
                   "" if r.mean_accepted_length is None else f"{r.mean_accepted_length:.2f}")
    console.print(c1)
    ceiling = report.ceiling
    if ceiling:
        ms = {name: value * 1e3 for name, value in ceiling.items() if name.endswith("_s")}
        console.print(f"ceiling at full acceptance: draft {ceiling['draft_ceiling_speedup']:.2f}x, n-gram "
                      f"{ceiling['ngram_ceiling_speedup']:.2f}x (decode {ms['target_decode_step_s']:.1f} ms, "
                      f"verify k+1 {ms['target_verify_step_s']:.1f} ms, drafting k {ms['drafting_s']:.1f} ms "
                      + ("as one compiled rollout" if ceiling.get("draft_rollout_s") else "as eager draft steps")
                      + f"; an eager draft step {ms['draft_step_s']:.2f} ms)")
    if report.draft_alpha:
        alpha = " ".join(f"{a:.2f}" for a in report.draft_alpha)
        console.print(f"draft acceptance per position (alpha, greedy, teacher-forced on the target's outputs): {alpha}")
    if ceiling and "draft_cost_per_token_s" in ceiling:
        console.print(f"cost per token: draft {ceiling['draft_cost_per_token_s'] * 1e3:.2f} ms, verify "
                      f"{ceiling['verify_cost_per_token_s'] * 1e3:.2f} ms, plain decode "
                      f"{ceiling['target_decode_step_s'] * 1e3:.2f} ms; expected at k={report.num_draft_tokens}: "
                      f"{ceiling.get('draft_expected_speedup_at_alpha', 0.0):.2f}x with "
                      f"{ceiling.get('draft_tokens_per_round', 0.0):.2f} tokens a round (greedy speculation replayed "
                      "over the target's outputs; prefill and the engine's per-step work left out)")
    if report.c1_draft_k_histogram:
        hist = " ".join(f"{k}:{v}" for k, v in sorted(report.c1_draft_k_histogram.items()))
        console.print(f"k chosen at c=1 (draft): {hist}")
    for system, split in report.c1_step_split.items():
        console.print(f"c=1 step, {system}: {split['steps']} steps of {split['step_ms']:.2f} ms = python "
                      f"{split['python_ms']:.2f}, attention {split['attention_ms']:.2f}, matmuls "
                      f"{split['matmuls_ms']:.2f}, sampling {split['sampling_ms']:.2f}, "
                      f"drafting {split['drafting_ms']:.2f}")
    if report.c1_prompts:
        _print_c1_prompts(console, report)
    if report.draft_rollout is not None:
        state = "on" if report.draft_rollout["enabled"] else "off"
        console.print(f"draft rollout {state} ({report.draft_rollout['reason']}): {report.draft_rollouts} rollouts "
                      "over the whole bench")
    if report.draft_token_map is not None:
        console.print(f"draft token map {report.draft_token_map}: the draft proposes {report.draft_token_map_size} "
                      "tokens (speculative.draft_token_map)")
    k_rule = "adaptive k" if report.adaptive else f"k = {report.num_draft_tokens} always"
    tp = Table(title=f"throughput, spec on / spec off ({k_rule}, best of interleaved repeats)")
    for col in ("c", "off tok/s", "draft tok/s", "n-gram tok/s", "draft on/off", "n-gram on/off", "draft k chosen"):
        tp.add_column(col, justify="right")
    for r in report.throughput:
        tp.add_row(str(r.concurrency), f"{r.spec_off_tokens_per_s:,.0f}", f"{r.spec_draft_tokens_per_s:,.0f}",
                   f"{r.spec_ngram_tokens_per_s:,.0f}", f"{r.draft_on_over_off:.2f}", f"{r.ngram_on_over_off:.2f}",
                   " ".join(f"{k}:{v}" for k, v in sorted(r.draft_k_histogram.items())))
    console.print(tp)
    for name, value in report.ratios.items():
        console.print(f"{name}: {value:.2f}")
    console.print(f"greedy output identical with spec off / draft / n-gram: {report.greedy_identical}")


def _print_decisions(console: Any, name: str, decisions: list[Any]) -> None:
    """The configuration a bench ran: the engine's start-up decisions (every `auto` it resolved, and why)."""
    console.print(f"{name} start-up decisions: " + "; ".join(f"{key} {value} ({why})" for key, value, why in decisions))


def _print_table(report: Any, concurrencies: list[int]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"tokens/s — {report.model} ({report.device}, {report.dtype}, {report.threads} thread(s), "
                        f"{report.output_len} tokens per request, best of {report.repeats} rounds)")
    table.add_column("system")
    for c in concurrencies:
        table.add_column(f"c={c}", justify="right")
    for system in ("engine", "hf_generate", "hf_generate_padded", "hf_generate_batch"):
        cells = []
        for c in concurrencies:
            match = [r for r in report.results if r.system == system and r.concurrency == c]
            if not match:
                cells.append("")
            elif match[0].note:
                cells.append("failed")
            else:
                cells.append(f"{match[0].tokens_per_s:,.0f}")
        if any(cells):
            table.add_row(system, *cells)
    console = Console(file=sys.stdout, width=120)
    console.print(table)
    for name, value in report.ratios.items():
        console.print(f"{name}: {value:.2f}x")
    _print_breakdown(console, report.breakdown)
    _print_decisions(console, "engine", report.decisions)


def _print_c1_prompts(console: Any, report: Any) -> None:
    """Each c=1 prompt's median latency per system, the draft's speed-up on it and the tokens a verification
    emitted: the slowest prompts are the c=1 P99, so this shows which prompts set it."""
    from rich.table import Table

    systems = [s for s in ("spec_off", "spec_draft", "spec_ngram") if s in report.c1_prompts[0].seconds]
    table = Table(title=f"c=1 per prompt (median of {report.c1_rounds} passes; the slowest set the P99)")
    for col in ("prompt", "prompt tokens", *(f"{s} s" for s in systems), "draft / off", "draft tokens/round",
                "n-gram tokens/round"):
        table.add_column(col, justify="right")
    slowest = max(report.c1_prompts, key=lambda p: p.seconds.get("spec_draft", 0.0))
    for p in report.c1_prompts:
        speedup = p.draft_speedup
        table.add_row(f"{p.prompt}{' *' if p is slowest else ''}", str(p.prompt_tokens),
                      *(f"{p.seconds[s]:.3f}" for s in systems), "" if speedup is None else f"{speedup:.2f}",
                      *(f"{p.tokens_per_round[s]:.2f}" if s in p.tokens_per_round else ""
                        for s in ("spec_draft", "spec_ngram")))
    console.print(table)


def _print_breakdown(console: Any, breakdown: list[Any]) -> None:
    """Where a step's time goes: Python (scheduling, metadata), attention, matmuls, sampling (, drafting)."""
    from rich.table import Table

    if not breakdown:
        return
    phases = ["python", "attention", "matmuls", "sampling"]
    if any(b.drafting_ms for b in breakdown):
        phases.append("drafting")
    table = Table(title="step time split (ms per step, share of the step; separate timed runs)")
    table.add_column("system")
    table.add_column("c", justify="right")
    table.add_column("step ms", justify="right")
    for phase in phases:
        table.add_column(phase, justify="right")
    for b in breakdown:
        table.add_row(getattr(b, "system", "engine"), str(b.concurrency), f"{b.step_ms:.2f}",
                      *(f"{getattr(b, phase + '_ms'):.2f} ({b.share(phase):.0%})" for phase in phases))
    console.print(table)
