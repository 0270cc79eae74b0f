"""`specdeploy bench server`: what the HTTP layer costs at concurrency 1.

The same prompts, output length (EOS ignored, greedy) and torch threads go straight into an
in-process engine and through a `specdeploy serve` process on loopback, alternately, one request at
a time (never both at once); the figure of merit is HTTP tokens/s ÷ engine tokens/s (goal ≥ 0.95),
reported over the whole run (`ratio`) and as the median of back-to-back pairs (`paired_ratio`,
the one the goal is checked against: robust to other processes' load on a shared machine).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from infra.bench.http import clean_environment
from infra.runtime.process import ServerProcess
from serving.net import free_port

GOAL = 0.95
SERVED_NAME = "bench"


@dataclass
class ServerBenchReport:
    model: str
    threads: int | str  # model.num_threads of both sides ("auto": each decided at its start-up)
    output_len: int
    requests: int
    stream: bool
    engine_tokens_per_s: float = 0.0
    http_tokens_per_s: float = 0.0
    engine_seconds: list[float] = field(default_factory=list)
    http_seconds: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    engine_cpu_s: list[float] = field(default_factory=list)  # CPU time of the bench process per request
    server_cpu_s: list[float] = field(default_factory=list)  # CPU time of the server process per request
    decisions: list[tuple[str, str, str]] = field(default_factory=list)  # the in-process engine's start-up decisions

    @property
    def ratio(self) -> float:
        """HTTP tokens/s ÷ engine tokens/s over the whole run."""
        return self.http_tokens_per_s / self.engine_tokens_per_s if self.engine_tokens_per_s else 0.0

    @property
    def paired_ratio(self) -> float:
        """Median over rounds of (engine seconds ÷ HTTP seconds) for the same prompt and length, run back
        to back: on a shared machine, load swings between rounds cancel out of each pair."""
        pairs = [e / h for e, h in zip(self.engine_seconds, self.http_seconds, strict=True) if h > 0]
        return statistics.median(pairs) if pairs else 0.0

    @property
    def cpu_ratio(self) -> float:
        """Engine CPU seconds ÷ server CPU seconds for the same work: the HTTP layer's cost in CPU,
        independent of how busy the machine is (0 where /proc is not available)."""
        server = sum(self.server_cpu_s)
        return sum(self.engine_cpu_s) / server if server > 0 else 0.0

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "ratio": round(self.ratio, 4), "paired_ratio": round(self.paired_ratio, 4),
                "cpu_ratio": round(self.cpu_ratio, 4), "goal": GOAL, "meets_goal": self.paired_ratio >= GOAL}


def run_server_benchmark(model_dir: Path, output_len: int, threads: int | str, requests: int,
                         stream: bool) -> ServerBenchReport:
    """Alternate engine and HTTP requests (same prompt each round), so load from other processes
    on a shared machine hits both sides alike."""
    import logging

    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the report
    report = ServerBenchReport(model=str(model_dir), threads=threads, output_len=output_len, requests=requests,
                               stream=stream)
    with tempfile.TemporaryDirectory(prefix="specdeploy-bench-") as tmp, _server(model_dir, Path(tmp), output_len,
                                                                                  threads) as (base, pid):
        engine, prompts = _load_engine(model_dir, threads, requests)
        report.decisions = engine.startup_decisions
        with httpx.Client(base_url=base, timeout=600) as client:
            _complete(client, prompts[0], 8, stream)  # warm-up
            engine_tokens = http_tokens = 0
            for round_index, prompt in enumerate(prompts):
                # ABBA order: a steady drift in machine load favours neither side.
                for side in ("engine", "http") if round_index % 2 == 0 else ("http", "engine"):
                    if side == "engine":
                        cpu = time.process_time()
                        result = _engine_request(engine, prompt, output_len)
                        report.engine_cpu_s.append(time.process_time() - cpu)
                        engine_tokens += result.output_tokens
                        report.engine_seconds.append(result.seconds)
                    else:
                        cpu = _process_cpu_s(pid)
                        started = time.perf_counter()
                        tokens, ttft = _complete(client, prompt, output_len, stream)
                        report.http_seconds.append(time.perf_counter() - started)
                        report.server_cpu_s.append(_process_cpu_s(pid) - cpu)
                        report.ttft_s.append(ttft)
                        http_tokens += tokens
        report.engine_tokens_per_s = engine_tokens / sum(report.engine_seconds)
        report.http_tokens_per_s = http_tokens / sum(report.http_seconds)
    return report


def _load_engine(model_dir: Path, threads: int | str, requests: int) -> tuple[Any, list[list[int]]]:
    from infra.bench.engine import bench_engine, default_prompts
    from serving.engine.config import EngineConfig
    from serving.engine.engine import LLMEngine

    engine = LLMEngine.from_config(EngineConfig(model=str(model_dir), device="cpu", num_threads=threads))
    prompts = default_prompts(model_dir, engine.tokenizer)
    prompts = [prompts[i % len(prompts)] for i in range(requests)]
    bench_engine(engine, prompts, 1, 8)  # warm-up
    return engine, prompts


def _engine_request(engine: Any, prompt: list[int], output_len: int) -> Any:
    from infra.bench.engine import bench_engine

    return bench_engine(engine, [prompt], 1, output_len)


@contextlib.contextmanager
def _server(model_dir: Path, workdir: Path, output_len: int, threads: int | str) -> Iterator[tuple[str, int]]:
    """`specdeploy serve` for the model (published to a scratch file:// store first), ready; yields its
    URL and pid."""
    from serving.weights import push

    store = f"file://{workdir / 'store'}"
    push(model_dir, store)
    port = free_port()
    config = {
        "service": {"host": "127.0.0.1", "port": port, "served_model_name": SERVED_NAME, "weights_uri": store},
        "model": {"path": str(workdir / "model"), "device": "cpu", "num_threads": threads},
        "scheduler": {"max_output_len": max(output_len, 16), "request_timeout_s": 600},
    }
    (workdir / "server.yaml").write_text(yaml.safe_dump(config))
    # the environment less thread variables and SPECDEPLOY_ overrides: the config decides
    server = ServerProcess(workdir / "server.yaml", port, clean_environment(), workdir / "server.log").start(600)
    try:
        assert server.pid is not None
        yield server.endpoint, server.pid
    finally:
        server.stop()


def _process_cpu_s(pid: int) -> float:
    """utime + stime of a process, from /proc (0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _complete(client: object, prompt: list[int], max_tokens: int, stream: bool) -> tuple[int, float]:
    """One greedy request; returns (generated tokens, seconds to the first streamed token or the response)."""
    import httpx

    assert isinstance(client, httpx.Client)
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    started = time.perf_counter()
    if not stream:
        response = client.post("/v1/completions", json=body)
        response.raise_for_status()
        return int(response.json()["usage"]["completion_tokens"]), time.perf_counter() - started
    ttft = 0.0
    tokens = 0
    body.update(stream=True, stream_options={"include_usage": True})
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and not ttft:
                ttft = time.perf_counter() - started
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    return tokens, ttft
