"""`specdeploy bench http`: speculation on ÷ off through HTTP, from the shortest server config that works.

Every server this bench starts is `specdeploy serve` with a config that names the model paths and nothing else
that bears on speed (its own port, a long request timeout); every other key is the server's default, and the
process gets no thread variables (OMP_NUM_THREADS, MKL_NUM_THREADS) and no SPECDEPLOY__ overrides. Each server's
start-up decisions (its one log line) are printed beside the figures.

Two runs:

- the plain config (default): a spec-off and a spec-on server (method draft, the two model paths), up together
  and never loaded together. At c = 1 each held-out code prompt goes to one, then the other (the order swaps
  every round): tokens/s on ÷ off, P99 latency on ÷ off, and whether the greedy texts are identical. At
  c > 1, rounds of closed loops of `c` workers over max(2c, 32) requests, an off and an on phase back to back
  in each: tokens/s under the load of c requests at once (each phase's drain left out: Phase), pooled over the
  rounds, with a 90 % interval from the rounds' paired ratios and the whole phases' figures beside them.
  With --threads-check, spec-off servers with every thread count 1..cores set explicitly give the c = 1
  figure the `auto` choice is held against.
- the load-safety matrix (--matrix): for each dtype, one spec-off server and, one at a time, a spec-on server
  per proposer configuration (draft: k x token map auto / none; n-gram: k), each measured against the spec-off
  server back to back at every concurrency. Its first row is a control: a second spec-off server, started fresh
  as each row's server is, measured the same way. It reads what the method does where the two servers do not
  differ: two spec-off servers can read several per cent apart at one concurrency, over rounds that put a
  tight interval on the difference (what is fixed for a server's life: its memory layout, where its threads
  land), and a row's cell within that distance of 1 is not told apart from it by one run.

Figures are ratios of the same run; the machine's noise (other processes) lands on both sides of a pair.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from infra.runtime.process import ServerProcess
from infra.validation import prom
from serving.metric_names import GENERATION_TOKENS
from serving.net import free_port

SERVED_NAME = "bench"
MIN_PHASE_REQUESTS = 32  # requests in a measured closed-loop phase at least (measure_loaded)
# the figures issue #34 holds the shipped defaults to
GOALS = {"c1_speedup": 2.5, "c1_p99_ratio": 0.5, "loaded_ratio": 0.97, "threads_ratio": 0.95}
_DECISIONS = re.compile(r"start-up decisions: (.*)$", re.MULTILINE)


@dataclass
class Variant:
    """One server: a name and the config keys it sets beyond the model paths (none for the plain config)."""

    name: str
    model: dict[str, Any] = field(default_factory=dict)
    speculative: dict[str, Any] = field(default_factory=dict)


@dataclass
class Pair:
    """One concurrency, spec on against spec off."""

    concurrency: int
    off_tokens_per_s: float
    on_tokens_per_s: float
    off_p99_s: float = 0.0
    on_p99_s: float = 0.0
    identical: int | None = None  # greedy texts identical on vs off, of `compared`
    compared: int | None = None
    # c > 1: the tokens/s above pool the steady windows (Phase) of every measured phase of each side; these pool
    # the same phases whole, drains included
    off_phase_tokens_per_s: float | None = None
    on_phase_tokens_per_s: float | None = None
    # c > 1: each measured phase's steady tokens/s in the order run, round by round (round r: off_rounds[r] and
    # on_rounds[r], back to back)
    off_rounds: list[float] = field(default_factory=list)
    on_rounds: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.on_tokens_per_s / self.off_tokens_per_s if self.off_tokens_per_s else 0.0

    @property
    def phase_ratio(self) -> float | None:
        """On ÷ off over whole phases, their drains included (c > 1)."""
        if not self.off_phase_tokens_per_s or self.on_phase_tokens_per_s is None:
            return None
        return self.on_phase_tokens_per_s / self.off_phase_tokens_per_s

    @property
    def interval(self) -> tuple[float, float] | None:
        """90 % confidence interval of on ÷ off from the rounds' paired ratios (c > 1, two rounds at least)."""
        return ratio_interval(self.off_rounds, self.on_rounds)

    @property
    def p99_ratio(self) -> float:
        return self.on_p99_s / self.off_p99_s if self.off_p99_s else 0.0

    def to_dict(self) -> dict[str, Any]:
        phase_ratio, interval = self.phase_ratio, self.interval
        return {**asdict(self), "ratio": round(self.ratio, 4), "p99_ratio": round(self.p99_ratio, 4),
                "phase_ratio": round(phase_ratio, 4) if phase_ratio is not None else None,
                "interval": [round(v, 4) for v in interval] if interval is not None else None}


# Student's t at 95 % one-sided (a 90 % two-sided interval) by degrees of freedom; past the table, 1.7 and then
# the normal quantile are within 3 % of it
_T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833, 10: 1.812,
        11: 1.796, 12: 1.782, 13: 1.771, 14: 1.761, 15: 1.753}


def ratio_interval(off: Sequence[float], on: Sequence[float]) -> tuple[float, float] | None:
    """A 90 % confidence interval of on ÷ off from paired rounds: the mean of log(on_r ÷ off_r) ± t x its
    standard error, back on the ratio scale. Pairing matters on a shared host: its speed moves by several per
    cent over seconds, and a round's two phases, back to back, see much the same host."""
    logs = [math.log(b / a) for a, b in zip(off, on, strict=True) if a > 0 and b > 0]
    if len(logs) < 2:
        return None
    df = len(logs) - 1
    t = _T95.get(df, 1.7 if df <= 30 else 1.645)
    half = t * statistics.stdev(logs) / math.sqrt(len(logs))
    mean = statistics.fmean(logs)
    return math.exp(mean - half), math.exp(mean + half)


@dataclass
class Phase:
    """One closed-loop phase of `requests` requests by `concurrency` workers.

    The steady window: the tokens the server generated (its generation counter on /metrics) from the phase's
    start until its last request was sent, over that time: the load of `concurrency` requests at once, each
    worker sending its next request as its last one returns. After that the phase drains: its last requests
    run with fewer and fewer beside them, and how long that lasts depends on how far the requests' ends have
    spread. Requests of one length that start together end together without speculation (one step finishes them
    all) and spread with it (the draft guesses some prompts better than others), so a drain charges the spec-on
    side alone. A service under steady load never drains; the steady window leaves it out for both sides alike.

    tokens and seconds: the whole phase, drain included.
    """

    steady_tokens: float
    steady_seconds: float
    tokens: int
    seconds: float
    latencies: list[float]

    @property
    def steady_tokens_per_s(self) -> float:
        return self.steady_tokens / self.steady_seconds if self.steady_seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class VariantResult:
    variant: Variant
    decisions: str  # the spec-on server's start-up decisions line
    pairs: list[Pair] = field(default_factory=list)
    # a spec-off server measured as a row is (the matrix's control): what the method reads where nothing differs
    control: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"variant": asdict(self.variant), "decisions": self.decisions, "control": self.control,
                "pairs": [p.to_dict() for p in self.pairs]}


@dataclass
class HttpBenchReport:
    target: str
    draft: str
    output_len: int
    prompts: int
    base_config: dict[str, Any]  # what every server's config file holds besides the variant's keys
    repeats: int = 1  # c = 1: rounds over the prompts; c > 1: rounds of an off and an on phase
    off_decisions: dict[str, str] = field(default_factory=dict)  # dtype -> the spec-off server's decisions line
    results: list[VariantResult] = field(default_factory=list)
    # spec-off c=1 tokens/s with num_threads auto ÷ with each explicit count, paired request by request
    threads_c1_ratio: dict[int, float] = field(default_factory=dict)

    @property
    def threads_ratio(self) -> float | None:
        """auto's spec-off c=1 tokens/s ÷ the best explicit thread count's."""
        return min(self.threads_c1_ratio.values()) if self.threads_c1_ratio else None

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "draft": self.draft, "output_len": self.output_len, "prompts": self.prompts,
                "repeats": self.repeats, "base_config": self.base_config, "off_decisions": self.off_decisions,
                "results": [r.to_dict() for r in self.results],
                "threads_c1_ratio": self.threads_c1_ratio, "threads_ratio": self.threads_ratio,
                "goals": GOALS}


def plain_variant() -> Variant:
    return Variant("draft (plain config)", speculative={"enabled": True, "method": "draft"})


def matrix_variants(ks: Sequence[int] = (4, 8, 12)) -> list[Variant]:
    """The load-safety matrix of one dtype: draft with and without its token map, and n-gram, at each k."""
    variants = [Variant(f"draft k={k} map={m}", speculative={"enabled": True, "method": "draft",
                                                            "num_draft_tokens": k, "draft_token_map": m})
                for k in ks for m in ("auto", "none")]
    variants += [Variant(f"ngram k={k}", speculative={"enabled": True, "method": "ngram", "num_draft_tokens": k})
                 for k in ks]
    return variants


def held_out_prompts(count: int) -> list[str]:
    """`count` held-out code prompts (serving/demo/prompts: files the demo pair never trained on), spread over
    the set's source files."""
    from serving.demo import load_prompts

    texts = [p.prompt for p in load_prompts("code")]
    if count > len(texts):
        raise ValueError(f"--prompts {count}: the held-out code set has {len(texts)} prompts")
    step = len(texts) // count
    return [texts[i * step] for i in range(count)]


def published(model_dir: Path, workdir: Path, name: str) -> Path:
    """The model as a deployment has it: pushed to a scratch file:// store and pulled back (hash-verified, with
    its manifest.json), as the server verifies it at start-up. Model directories that carry a manifest already
    are used where they are."""
    from serving.weights import ensure_local, push
    from serving.weights.manifest import MANIFEST_NAME

    if (model_dir / MANIFEST_NAME).is_file():
        return model_dir
    store = f"file://{workdir / 'store' / name}"
    push(model_dir, store)
    local = workdir / "models" / name
    ensure_local(local, store)
    return local


def server_config(target: Path, draft: Path, variant: Variant, port: int, output_len: int) -> dict[str, Any]:
    """The config file of one server: the model paths, the variant's keys, and a port and timeout."""
    speculative = dict(variant.speculative)
    if speculative.get("enabled") and speculative.get("method", "draft") == "draft":
        speculative["draft_model"] = str(draft)
    config: dict[str, Any] = {
        "service": {"host": "127.0.0.1", "port": port, "served_model_name": SERVED_NAME},
        "model": {"path": str(target), **variant.model},
        # a limit, not a speed setting: a 64-request wave on a 2-core CPU outlasts the 60 s default
        "scheduler": {"request_timeout_s": 600, "max_output_len": max(output_len, 1024)},
    }
    if speculative:
        config["speculative"] = speculative
    return config


def clean_environment() -> dict[str, str]:
    """This process's environment less what would override the server's own choices."""
    dropped = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
    return {k: v for k, v in os.environ.items()
            if not k.startswith("SPECDEPLOY") and k not in dropped} | {"SPECDEPLOY_ENV": "development"}


@contextlib.contextmanager
def serving(workdir: Path, target: Path, draft: Path, variant: Variant, output_len: int,
            ready_timeout_s: float = 900) -> Iterator[tuple[ServerProcess, str]]:
    """A ready server for the variant; yields it and its start-up decisions line."""
    port = free_port()
    slug = re.sub(r"[^a-z0-9]+", "-", variant.name.lower()).strip("-")
    config_path = workdir / f"{slug}.yaml"
    config_path.write_text(yaml.safe_dump(server_config(target, draft, variant, port, output_len)))
    log_path = workdir / f"{slug}.log"
    log_path.write_text("")
    server = ServerProcess(config_path, port, clean_environment(), log_path).start(ready_timeout_s)
    try:
        found = _DECISIONS.findall(log_path.read_text(encoding="utf-8", errors="replace"))
        yield server, found[-1] if found else "(no start-up decisions line in the server log)"
    finally:
        server.stop()


async def _complete(client: httpx.AsyncClient, base: str, prompt: str, output_len: int) -> tuple[float, int, str]:
    """One greedy completion (EOS ignored): (seconds, completion tokens, text)."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True}
    started = time.perf_counter()
    response = await client.post(f"{base}/v1/completions", json=body)
    seconds = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{base}: HTTP {response.status_code}: {response.text[:300]}")
    payload = response.json()
    return seconds, int(payload["usage"]["completion_tokens"]), str(payload["choices"][0]["text"])


async def generated_tokens(client: httpx.AsyncClient, base: str) -> tuple[float, float]:
    """(when, the server's generation counter then): `when` is the middle of the /metrics round trip."""
    sent = time.perf_counter()
    response = await client.get(f"{base}/metrics")
    when = (sent + time.perf_counter()) / 2
    if response.status_code != 200:
        raise RuntimeError(f"{base}/metrics: HTTP {response.status_code}: {response.text[:300]}")
    generated = prom.value(prom.parse(response.text), f"{GENERATION_TOKENS}_total")
    if generated is None:
        raise RuntimeError(f"{base}/metrics has no {GENERATION_TOKENS}_total series")
    return when, generated


async def _closed_loop(client: httpx.AsyncClient, base: str, prompts: Sequence[str], concurrency: int,
                       requests: int, output_len: int) -> Phase:
    """`concurrency` workers over `requests` requests (Phase: its steady and whole tokens/s, each request's
    seconds). With requests <= concurrency there is no steady window: its figure is the whole phase's."""
    queue = list(range(requests))
    latencies: list[float] = []
    tokens = 0
    window_end: asyncio.Task[tuple[float, float]] | None = None

    async def worker() -> None:
        nonlocal tokens, window_end
        while queue:
            i = queue.pop()
            if not queue and requests > concurrency:  # the last request goes out: the drain starts
                window_end = asyncio.create_task(generated_tokens(client, base))
            seconds, n, _ = await _complete(client, base, prompts[i % len(prompts)], output_len)
            latencies.append(seconds)
            tokens += n

    window_start = await generated_tokens(client, base) if requests > concurrency else None
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - started
    steady: tuple[float, float] = (tokens, seconds)  # no steady window: the whole phase
    if window_start is not None and window_end is not None:
        (t0, n0), (t1, n1) = window_start, await window_end
        if t1 > t0:
            steady = (n1 - n0, t1 - t0)
    return Phase(*steady, tokens, seconds, latencies)


def p99(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


async def measure_c1(off: str, on: str, prompts: Sequence[str], output_len: int, repeats: int) -> Pair:
    """Each prompt on both servers back to back, the order swapped every round."""
    seconds: dict[str, list[float]] = {off: [], on: []}
    tokens: dict[str, int] = {off: 0, on: 0}
    texts: dict[str, dict[int, str]] = {off: {}, on: {}}
    async with httpx.AsyncClient(timeout=900) as client:
        for base in (off, on):  # warm-up: one short request each
            await _complete(client, base, prompts[0], 8)
        for round_ in range(repeats):
            for i, prompt in enumerate(prompts):
                for base in ((off, on) if (round_ + i) % 2 == 0 else (on, off)):
                    s, n, text = await _complete(client, base, prompt, output_len)
                    seconds[base].append(s)
                    tokens[base] += n
                    texts[base].setdefault(i, text)
    identical = sum(texts[off][i] == texts[on][i] for i in texts[off])
    return Pair(1, tokens[off] / sum(seconds[off]), tokens[on] / sum(seconds[on]), p99(seconds[off]),
                p99(seconds[on]), identical, len(texts[off]))


async def measure_loaded(off: str, on: str, prompts: Sequence[str], concurrency: int, output_len: int,
                         repeats: int) -> Pair:
    """`repeats` rounds of closed loops of `concurrency` over max(2 x concurrency, MIN_PHASE_REQUESTS) requests:
    in each round an off and an on phase back to back, the order swapped every round. Each side's figure pools
    its phases' steady windows (Phase): their tokens over their seconds. The same phases' whole figures, drains
    included, and each phase's steady figure (Pair.off_rounds, on_rounds: the rounds' paired ratios give the
    interval) are kept beside them; the P99 is over every measured request of the side. MIN_PHASE_REQUESTS
    keeps a steady window of several waves at low concurrency, where 2c requests would give it one.

    The phases are pooled, not the best of each side taken: a shared host's speed moves by several per cent over
    seconds, both ways, so a side's best phase is as much its luck as its speed, and only more phases narrow it.

    Each server first runs one unmeasured phase at this concurrency: a server's first phase at a new load ran
    10-25 % below its later ones (first-touch of KV cache pages, allocator growth, the adaptive policy's and the
    guard's first samples), and in the matrix the spec-off server, shared by every row, was warm where each new
    spec-on server was not."""
    phases: dict[str, list[Phase]] = {off: [], on: []}

    async def phase(base: str, requests: int) -> Phase:
        # a client per phase: a server closes connections idle past its keep-alive while the other phase runs
        async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=512)) as client:
            return await _closed_loop(client, base, prompts, concurrency, requests, output_len)

    for base in (off, on):
        await phase(base, concurrency)
    for round_ in range(repeats):
        for base in ((off, on) if round_ % 2 == 0 else (on, off)):
            phases[base].append(await phase(base, max(2 * concurrency, MIN_PHASE_REQUESTS)))

    def pooled(side: list[Phase], steady: bool) -> float:
        tokens = sum(p.steady_tokens if steady else p.tokens for p in side)
        seconds = sum(p.steady_seconds if steady else p.seconds for p in side)
        return tokens / seconds if seconds > 0 else 0.0

    return Pair(concurrency, pooled(phases[off], True), pooled(phases[on], True),
                p99([s for p in phases[off] for s in p.latencies]), p99([s for p in phases[on] for s in p.latencies]),
                off_phase_tokens_per_s=pooled(phases[off], False), on_phase_tokens_per_s=pooled(phases[on], False),
                off_rounds=[p.steady_tokens_per_s for p in phases[off]],
                on_rounds=[p.steady_tokens_per_s for p in phases[on]])


def run_plain(target: Path, draft: Path, concurrency: Sequence[int], output_len: int, num_prompts: int,
              repeats: int, threads_check: bool, workdir: Path, say: Any = print) -> HttpBenchReport:
    prompts = held_out_prompts(num_prompts)
    report = HttpBenchReport(str(target), str(draft), output_len, num_prompts,
                             server_config(target, draft, Variant("base"), 0, output_len), repeats)
    target, draft = published(target, workdir, "target"), published(draft, workdir, "draft")
    off_variant, on_variant = Variant("off"), plain_variant()
    with serving(workdir, target, draft, off_variant, output_len) as (off, off_decisions), \
            serving(workdir, target, draft, on_variant, output_len) as (on, on_decisions):
        report.off_decisions["default"] = off_decisions
        result = VariantResult(on_variant, on_decisions)
        report.results.append(result)
        for c in concurrency:
            say(f"c={c} ...")
            if c == 1:
                pair = asyncio.run(measure_c1(off.endpoint, on.endpoint, prompts, output_len, repeats))
            else:
                pair = asyncio.run(measure_loaded(off.endpoint, on.endpoint, prompts, c, output_len, repeats))
            result.pairs.append(pair)
    if threads_check:
        from serving.engine.cpu_threads import usable_cores

        # fresh spec-off servers on both sides: one that has served the loaded phases measured ~10 % slower at
        # c=1 than a fresh one with the same settings
        for n in range(1, usable_cores() + 1):
            say(f"spec off, model.num_threads auto against {n}, c=1 ...")
            with serving(workdir, target, draft, Variant("off threads=auto"), output_len) as (auto, _), \
                    serving(workdir, target, draft, Variant(f"off threads={n}", model={"num_threads": n}),
                            output_len) as (fixed, _):
                pair = asyncio.run(measure_c1(auto.endpoint, fixed.endpoint, prompts, output_len, repeats))
            report.threads_c1_ratio[n] = pair.off_tokens_per_s / pair.on_tokens_per_s
    return report


def run_matrix(target: Path, draft: Path, concurrency: Sequence[int], output_len: int, num_prompts: int,
               repeats: int, dtypes: Sequence[str], ks: Sequence[int], workdir: Path,
               say: Any = print, only: Sequence[str] = ()) -> HttpBenchReport:
    """only: run just the variants whose name (e.g. "draft k=12 map=none dtype=fp32") contains one of these."""
    prompts = held_out_prompts(num_prompts)
    report = HttpBenchReport(str(target), str(draft), output_len, num_prompts,
                             server_config(target, draft, Variant("base"), 0, output_len), repeats)
    target, draft = published(target, workdir, "target"), published(draft, workdir, "draft")
    for dtype in dtypes:
        model = {} if dtype == "auto" else {"dtype": dtype}
        with serving(workdir, target, draft, Variant(f"off {dtype}", model=model), output_len) as (off, decisions):
            report.off_decisions[dtype] = decisions
            rows = [Variant(f"{v.name} dtype={dtype}", model=model, speculative=v.speculative)
                    for v in matrix_variants(ks)]
            rows = [v for v in rows if not only or any(part in v.name for part in only)]
            # the control: a second spec-off server, fresh as each row's is, measured as the rows are
            for variant, control in [(Variant(f"control: spec off dtype={dtype}", model=model), True)] + \
                    [(v, False) for v in rows]:
                say(f"{variant.name} ...")
                with serving(workdir, target, draft, variant, output_len) as (on, on_decisions):
                    result = VariantResult(variant, on_decisions, control=control)
                    for c in concurrency:
                        result.pairs.append(asyncio.run(measure_loaded(off.endpoint, on.endpoint, prompts, c,
                                                                       output_len, repeats)))
                report.results.append(result)
    return report


def scratch_dir(keep: Path | None) -> contextlib.AbstractContextManager[str]:
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        return contextlib.nullcontext(str(keep))
    return tempfile.TemporaryDirectory(prefix="specdeploy-bench-http-")


def summary(report: HttpBenchReport) -> dict[str, Any]:
    """The figures the goals are checked against: the worst loaded ratio and how many loaded cells meet the goal,
    and the plain config's c=1 ones; and the control rows' ratios, which read what the method does where the two
    servers do not differ."""
    loaded = [p for r in report.results if not r.control for p in r.pairs if p.concurrency > 1]
    c1 = [p for r in report.results if not r.control for p in r.pairs if p.concurrency == 1]
    out: dict[str, Any] = {"worst_loaded_ratio": round(min(p.ratio for p in loaded), 4) if loaded else None}
    if loaded:
        out["loaded_at_goal"] = f"{sum(p.ratio >= GOALS['loaded_ratio'] for p in loaded)}/{len(loaded)}"
    if c1:
        out.update(c1_speedup=round(c1[0].ratio, 4), c1_p99_ratio=round(c1[0].p99_ratio, 4),
                   identical=f"{c1[0].identical}/{c1[0].compared}")
    if report.threads_ratio is not None:
        out["threads_ratio"] = round(report.threads_ratio, 4)
    controls = {f"{r.variant.name} c={p.concurrency}": round(p.ratio, 4)
                for r in report.results if r.control for p in r.pairs}
    if controls:
        out["control_ratios"] = controls
    return out


def dumps(report: HttpBenchReport) -> str:
    return json.dumps({**report.to_dict(), "summary": summary(report)}, indent=2)
