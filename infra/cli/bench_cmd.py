"""`specdeploy bench engine`: our engine's throughput against transformers, printed as JSON and a table.

`bench server` (HTTP vs engine) is registered here too, from the server's own bench_server module.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from infra.cli.main import CommandError


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
    engine.add_argument("--threads", type=int, default=1,
                        help="torch threads for every system measured (default 1: fastest for small models "
                             "on a shared CPU)")
    engine.add_argument("--device", default="cpu", help="cpu or cuda")
    engine.add_argument("--no-baselines", action="store_true", help="skip the transformers baselines")
    engine.add_argument("--profile", action="store_true", help="append a torch.profiler op table")
    engine.add_argument("--json-out", type=Path, help="also write the JSON report to this file")
    engine.set_defaults(func=_bench_engine)

    try:  # `bench server` (HTTP vs engine) belongs to the server and lives beside this module
        from infra.cli.bench_server import register_server
    except ImportError:
        return
    register_server(actions)


def _model_dir(arg: Path | None) -> Path:
    if arg is not None:
        path = arg
    else:
        from serving.demo import target_path

        path = target_path()
    if not (path / "config.json").is_file():
        raise CommandError(f"no model at {path} (config.json missing); pass --model DIR")
    return path


def _bench_engine(args: argparse.Namespace) -> int:
    from serving.engine.benchmark import run_engine_benchmark

    try:
        concurrencies = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    except ValueError as exc:
        raise CommandError(f"--concurrency must be integers separated by commas: {exc}") from exc
    if not concurrencies or min(concurrencies) < 1:
        raise CommandError("--concurrency needs at least one positive integer")
    report = run_engine_benchmark(_model_dir(args.model), concurrencies, args.output_len, args.threads,
                                  baselines=not args.no_baselines, profile=args.profile, device=args.device)
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


def _print_table(report: Any, concurrencies: list[int]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"tokens/s — {report.model} ({report.device}, {report.dtype}, {report.threads} thread(s), "
                        f"{report.output_len} tokens per request)")
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
