"""`specdeploy bench server`: HTTP tokens/s at c=1 ÷ engine tokens/s at c=1 (goal ≥ 0.95).

Exit 1 when the paired ratio (see infra.bench.server) is below the goal.

Registered under `specdeploy bench` by ``infra/ops/cli/bench_cmd.py`` (``register_server(actions)``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from infra.ops.cli.main import CommandError


def register_server(actions: Any) -> None:
    server = actions.add_parser(
        "server",
        help="tokens/s through HTTP at c=1 divided by the engine's own at c=1 (goal >= 0.95)",
        description="Same prompts, output length (EOS ignored, greedy) and torch threads, first straight into "
        "the engine, then through `specdeploy serve` on loopback. Exit 1 when the ratio is below the goal.",
    )
    server.add_argument("--model", type=Path, help="model directory (default: the demo target)")
    server.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    server.add_argument("--requests", type=int, default=4, help="sequential requests per side (c=1)")
    from infra.ops.cli.bench_cmd import THREADS_ARG

    server.add_argument("--threads", **THREADS_ARG)
    server.add_argument("--stream", action="store_true", help="stream the HTTP responses (SSE)")
    server.add_argument("--json-out", type=Path, help="also write the JSON report to this file")
    server.set_defaults(func=_bench_server)


def _bench_server(args: argparse.Namespace) -> int:
    from rich.console import Console

    from infra.bench.server import GOAL, run_server_benchmark

    model = args.model
    if model is None:
        from serving.demo import target_path

        model = target_path()
    if not (model / "config.json").is_file():
        raise CommandError(f"no model at {model} (config.json missing); pass --model DIR")
    if args.requests < 1 or args.output_len < 2:
        raise CommandError("--requests must be >= 1 and --output-len >= 2")
    try:
        report = run_server_benchmark(model, args.output_len, args.threads, args.requests, args.stream)
    except RuntimeError as exc:
        raise CommandError(str(exc)) from exc
    data = report.to_dict()
    sys.stdout.write(json.dumps(data, indent=2) + "\n")
    if args.json_out:
        args.json_out.write_text(json.dumps(data, indent=2) + "\n")
    verdict = "[green]meets[/]" if report.paired_ratio >= GOAL else "[red]below[/]"
    console = Console(file=sys.stdout, width=120)
    console.print("engine start-up decisions (the server takes the same from the same config): "
                  + "; ".join(f"{key} {value} ({why})" for key, value, why in report.decisions))
    console.print(
        f"engine c=1: {report.engine_tokens_per_s:,.1f} tok/s   HTTP c=1 ({'stream' if args.stream else 'json'}): "
        f"{report.http_tokens_per_s:,.1f} tok/s   ratio {report.ratio:.3f}   paired ratio (median) "
        f"{report.paired_ratio:.3f} ({verdict} the {GOAL} goal)   CPU-time ratio {report.cpu_ratio:.3f}"
    )
    return 0 if report.paired_ratio >= GOAL else 1
