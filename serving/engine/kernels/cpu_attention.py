"""Decode and verify attention read in place from the paged KV cache on CPU (`model.cpu_decode_attention`).

The CPU attention path gathers a group's context blocks into one `[G, Hkv, K, D]` tensor and runs SDPA on the
copy: every key and value is read, written, and read again. At 32 decoding sequences that was half of the demo
target's step (4.6 of 9.3 ms). For groups of queries up to `model.KERNEL_MAX_QUERY` = 16 tokens per sequence
(decode steps, and verify steps of up to 15 drafts) a small C++ kernel, `csrc/cpu_decode_attention.cpp`, reads
each sequence's keys and values where they sit in the block pool instead: one pass over the context, block by
block, with an online softmax (each block's keys, then its values); from 4 query tokens on, a tiled walk one KV
head at a time (AVX2, head dim a multiple of 32). Measured through the model's own attention on the demo target
(4 KV heads x 2, head dim 32, 16-token blocks, a KV cache larger than the CPU's caches, one thread, before the
one-pass walk, which took another 4-16 % off), the kernel's time as a share of gather + SDPA's:
0.30-0.47 for decode groups of 1-64 sequences, 0.50-0.74 at 3-9 query tokens of one sequence, 0.85-0.87 at
13-16, and 0.54-0.92 at 3-16 tokens of 16 sequences (docs/benchmarks/log.md). Prefill chunks keep gather + SDPA.

Built at start-up with the host's C++ compiler (`-O3 -march=native`, half a second) into a cache directory,
keyed by the source, the flags, the compiler and the CPU, and loaded with ctypes: a plain C ABI, no torch
headers. The server image has no compiler: its build stage compiles portable variants instead
(`python -m serving.engine.kernels.cpu_attention prebuild DIR`: x86-64-v3 with AVX2 and FMA, baseline x86-64, or
armv8-a), and a host without a compiler loads the best one its CPU runs. With neither, the decision says so and
attention gathers.

- `auto` (default): on CPU, fp32, without tensor parallelism, the kernel is built, checked against gather + SDPA
  on random data (decode groups and a verify-shaped group), and a decode group of 1 and of 16 sequences is timed
  both ways on the model's own attention (7 interleaved rounds); the kernel is kept if it takes at most 0.95 of
  the gather path's time.
- `on`: kept wherever it applies, without timing (still checked); a model where it cannot apply is refused by
  name. `off`: never.

Outputs differ from SDPA's only in summation order and the exponential (a few 1e-7 relative).

`python -m serving.engine.kernels.cpu_attention compare OTHER.cpp` builds this source and another version of it with the
same compiler and flags and prints, per decode and verify shape, both times, their ratio and the largest
difference between their outputs (how a change to the kernel is measured).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from serving.config import DecodeAttentionMode
from serving.engine.batch import ForwardBatch, ForwardBatchBuilder, SequenceInput, build_forward_batch
from serving.engine.kv_cache import KVCache
from serving.engine.model import KERNEL_MAX_QUERY, Attention, Transformer
from serving.engine.timing import interleaved_medians

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_decode_attention.cpp"
COMPILERS = ("c++", "g++", "clang++")
COMMON_FLAGS = ("-O3", "-fopenmp-simd", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")
FLAGS = (*COMMON_FLAGS, "-march=native")
PREBUILT_DIR = Path(__file__).parent / "prebuilt"  # portable builds, made by the server image's build stage
# per machine, best first: (name, -march flags, CPU flags the build needs, as /proc/cpuinfo spells them)
PORTABLE: dict[str, list[tuple[str, tuple[str, ...], tuple[str, ...]]]] = {
    # x86-64-v3 as the psABI defines it: AVX2, FMA, BMI1/2, F16C, LZCNT (cpuinfo: abm), MOVBE, XSAVE, and v2 below
    "x86_64": [("x86-64-v3", ("-march=x86-64-v3", "-mtune=generic"),
                ("avx2", "fma", "bmi1", "bmi2", "f16c", "abm", "movbe", "xsave", "sse4_2", "popcnt", "cx16")),
               ("x86-64", ("-march=x86-64", "-mtune=generic"), ())],
    "aarch64": [("armv8-a", ("-march=armv8-a",), ())],
}
CACHE_ENV = "SPECDEPLOY_KERNEL_CACHE"  # where built kernels are kept (default: ~/.cache/specdeploy/kernels)
_SYMBOL = "specdeploy_decode_attention_f32"
_ROUNDS, _CALLS = 7, 5  # auto: interleaved timing rounds, calls per round and shape
_KEEP_BELOW = 0.95  # auto keeps the kernel at or under this share of the gather path's time
_TOLERANCE = 1e-4  # largest difference from gather + SDPA the start-up check accepts (outputs are O(1))


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded on this host; the message says why."""


@dataclass
class AttentionDecision:
    model: str  # "target" or "draft"
    kernel: bool  # decode and verify groups attend through the kernel
    reason: str  # why (measured times, or why it does not apply)
    gather_ms: float | None = None  # the timed decode groups through gather + SDPA, median of the rounds (auto)
    kernel_ms: float | None = None


def find_compiler() -> str | None:
    for name in COMPILERS:
        found = shutil.which(name)
        if found:
            return found
    return None


def cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specdeploy" / "kernels"


def _cpuinfo(*keys: str) -> list[str]:
    """The distinct /proc/cpuinfo lines of these keys (empty where there is no /proc/cpuinfo)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return sorted({line for line in info.splitlines() if line.startswith(keys)})


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and feature flags (a cache shared by several hosts must
    not hand one CPU's build to another)."""
    return "\n".join(_cpuinfo("model name", "flags", "Features")) or platform.processor() or platform.machine()


def _compile(compiler: str, flags: tuple[str, ...], target: Path, source: Path = SOURCE) -> None:
    """Compile the source to `target`, under a temporary name renamed at the end, so a concurrent or interrupted
    build never leaves a partial library where a loader would find it."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=target.parent, prefix=".building-", suffix=".so")
        os.close(fd)
    except OSError as e:
        raise KernelUnavailable(f"cannot write the kernel cache {target.parent}: {e} (set {CACHE_ENV})") from e
    try:
        done = subprocess.run([compiler, *flags, str(source), "-o", partial], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            raise KernelUnavailable(f"{compiler} failed to build {source.name} (exit {done.returncode}): "
                                    f"{done.stderr.strip()[-500:]}")
        os.chmod(partial, 0o755)  # mkstemp makes it 0600: readable to other users (the image's server user)
        os.replace(partial, target)
    except subprocess.SubprocessError as e:
        raise KernelUnavailable(f"{compiler} failed to build {source.name}: {e}") from e
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _source_digest() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


def build(directory: Path | None = None, defines: tuple[str, ...] = ()) -> Path:
    """The shared library for this host (-march=native), compiled unless a build of the same source, flags,
    compiler and CPU is cached. defines: preprocessor names set (the tests build the kernel's portable path
    with SPECDEPLOY_GENERIC)."""
    compiler = find_compiler()
    if compiler is None:
        raise KernelUnavailable(f"no C++ compiler on PATH (looked for {', '.join(COMPILERS)})")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"{compiler} --version failed: {e}") from e
    flags = (*FLAGS, *(f"-D{name}" for name in defines))
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(flags).encode(), version.encode(),
                                     _cpu_identity().encode()])).hexdigest()[:20]
    directory = cache_dir() if directory is None else directory
    target = directory / f"cpu_decode_attention-{key}.so"
    if not target.exists():
        _compile(compiler, flags, target)
        log.info("built the CPU decode attention kernel: %s", target)
    return target


def prebuild(directory: Path) -> list[Path]:
    """Portable builds for this machine architecture (PORTABLE), named by the source's digest so that a loader
    never takes a build of other source. For an image whose runtime has no compiler."""
    compiler = find_compiler()
    if compiler is None:
        raise KernelUnavailable(f"no C++ compiler on PATH (looked for {', '.join(COMPILERS)})")
    variants = PORTABLE.get(platform.machine())
    if not variants:
        raise KernelUnavailable(f"no portable build is defined for {platform.machine()}")
    built = []
    for name, march, _ in variants:
        target = directory / f"cpu_decode_attention-{_source_digest()}-{name}.so"
        _compile(compiler, (*COMMON_FLAGS, *march), target)
        built.append(target)
    return built


def _cpu_flags() -> set[str]:
    """Features every core lists (x86 `flags`, ARM `Features`)."""
    lines = [set(line.split(":", 1)[1].split()) for line in _cpuinfo("flags", "Features")]
    return set.intersection(*lines) if lines else set()


def find_prebuilt(directory: Path | None = None) -> tuple[Path, str] | None:
    """The best portable build in `directory` (default PREBUILT_DIR) that this CPU runs, and its name; None if
    there is none."""
    directory = PREBUILT_DIR if directory is None else directory
    flags = _cpu_flags()
    for name, _, needs in PORTABLE.get(platform.machine(), []):
        path = directory / f"cpu_decode_attention-{_source_digest()}-{name}.so"
        if path.exists() and set(needs) <= flags:
            return path, name
    return None


class DecodeAttentionKernel:
    """The loaded kernel: attention of a few query tokens per sequence (decode, verify) over its paged context."""

    def __init__(self, path: Path, origin: str = "built for this CPU") -> None:
        try:
            self._lib = ctypes.CDLL(str(path))
            fn = getattr(self._lib, _SYMBOL)
        except (OSError, AttributeError) as e:
            raise KernelUnavailable(f"cannot load {path}: {e}") from e
        fn.restype = ctypes.c_int
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float]
        self._fn = fn
        self.path = path
        self.origin = origin  # "built for this CPU", or which portable build (reported in the decision)

    def __call__(self, q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, tables: torch.Tensor,
                 q_start: torch.Tensor, seq_lens: torch.Tensor, n_rep: int, scale: float) -> torch.Tensor:
        """q [G * T, Hq, D] fp32: T query tokens per sequence, token rows may be strided; k/v_blocks
        [num_blocks, block_size, Hkv, D] contiguous; tables [G, >= blocks used] int64 (rows may be strided);
        q_start [G] int64, each sequence's first query position (its token j sits at q_start + j and sees the keys
        up to it); seq_lens [G] int64, the keys each sequence holds after the step. Returns [G * T, Hq * D].
        The caller guarantees every table entry read is a block of the pool."""
        rows, hq, d = q.shape
        g = seq_lens.shape[0]
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        if tables.stride(1) != 1:
            tables = tables.contiguous()
        q_start, seq_lens = q_start.contiguous(), seq_lens.contiguous()
        _, block_size, hkv, _ = k_blocks.shape
        out = torch.empty(rows, hq * d, dtype=q.dtype)
        rc = self._fn(q.data_ptr(), q.stride(0), rows // g, q_start.data_ptr(), k_blocks.data_ptr(),
                      v_blocks.data_ptr(), tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(), out.data_ptr(),
                      g, hkv, n_rep, d, block_size, scale)
        if rc != 0:
            raise ValueError(f"attention kernel refused its input (a sequence length <= 0: {seq_lens.tolist()})")
        return out


@cache
def load() -> DecodeAttentionKernel:
    """The kernel for this process, loaded once: built for this CPU where a compiler is on PATH and the build
    succeeds, else the best portable build shipped beside the source; raises KernelUnavailable with the
    reasons."""
    try:
        return DecodeAttentionKernel(build())
    except KernelUnavailable as e:
        found = find_prebuilt()
        if found is None:
            raise KernelUnavailable(f"{e}, and no prebuilt kernel for this CPU in {PREBUILT_DIR}") from e
    path, name = found
    return DecodeAttentionKernel(path, f"prebuilt {name}")


def unsupported_reason(device: torch.device, dtype: torch.dtype, tensor_parallel: bool) -> str | None:
    if device.type != "cpu":
        return f"the kernel is for CPU; this model is on {device.type}"
    if dtype != torch.float32:
        return f"the kernel is fp32; this model runs {dtype}"
    if tensor_parallel:
        return "not with tensor parallelism (the worker ranks attend through gather + SDPA)"
    return None


def _step_batch(model: Transformer, cache: KVCache, num_seqs: int, context: int, generator: torch.Generator,
                query: int = 1) -> ForwardBatch:
    """A step of num_seqs sequences with `query` new tokens each after about `context` cached ones, their blocks
    scattered over the pool."""
    bs = cache.block_size
    per_seq = -(-(context + query) // bs)
    order = torch.randperm(cache.num_blocks, generator=generator)[: num_seqs * per_seq].view(num_seqs, per_seq)
    seqs = [SequenceInput([1] * query, context - (i % 3), order[i].tolist(), list(range(query)))
            for i in range(num_seqs)]
    return build_forward_batch(seqs, bs, model.args.n_rep, model.device, model.dtype)


def _attend(attention: Attention, q: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
    return torch.cat([attention.attend_group(q, group, cache, 0) for group in batch.groups])


@torch.inference_mode()
def _check_and_time(model: Transformer, kernel: DecodeAttentionKernel, timed: bool) -> tuple[float, float | None,
                                                                                              float | None]:
    """Compare the kernel with gather + SDPA on the model's first attention layer over a random cache (largest
    difference; decode groups of 1 and 16 sequences and a group of 4 with the longest query the kernel takes), and
    with `timed` time both on the decode groups (medians in seconds)."""
    args = model.args
    context = max(min(256, model.max_model_len - 1), 2)
    groups = (1, 16)
    bs = 16
    num_blocks = max(groups) * (-(-(context + KERNEL_MAX_QUERY) // bs)) + 4
    generator = torch.Generator().manual_seed(0)
    cache = KVCache(1, num_blocks, bs, args.n_kv_heads, args.head_dim, torch.float32, torch.device("cpu"))
    cache.k.normal_(generator=generator)
    cache.v.normal_(generator=generator)
    attention = model.layers[0].attention
    assert isinstance(attention, Attention)
    batches = [_step_batch(model, cache, g, context, generator) for g in groups]
    verify = _step_batch(model, cache, 4, context, generator, KERNEL_MAX_QUERY)
    queries = [torch.randn(b.num_tokens, args.n_heads, args.head_dim, generator=generator)
               for b in (*batches, verify)]
    previous = attention.decode_kernel
    try:
        worst = 0.0
        for batch, q in zip((*batches, verify), queries, strict=True):
            attention.decode_kernel = None
            want = _attend(attention, q, batch, cache)
            attention.decode_kernel = kernel
            got = _attend(attention, q, batch, cache)
            worst = max(worst, (got - want).abs().max().item())
        if not timed:
            return worst, None, None
        def decode_groups(through: DecodeAttentionKernel | None) -> float:
            attention.decode_kernel = through
            start = time.perf_counter()
            for _ in range(_CALLS):
                for batch, q in zip(batches, queries, strict=False):  # the decode groups
                    _attend(attention, q, batch, cache)
            return (time.perf_counter() - start) / _CALLS

        gather_s, kernel_s = interleaved_medians([lambda: decode_groups(None), lambda: decode_groups(kernel)],
                                                 _ROUNDS)
        return worst, gather_s, kernel_s
    finally:
        attention.decode_kernel = previous


def choose_for(model: Transformer, name: str, builder: ForwardBatchBuilder, mode: DecodeAttentionMode,
               tensor_parallel: bool) -> AttentionDecision:
    """`choose` for one model of an engine, and its batch builder told which groups the kernel reads in place:
    those need not be split to keep a gathered copy in the CPU's caches."""
    decision = choose(model, name, mode, unsupported_reason(model.device, model.dtype, tensor_parallel))
    builder.in_place_max_q = KERNEL_MAX_QUERY if decision.kernel else 0
    return decision


def choose(model: Transformer, name: str, mode: DecodeAttentionMode, reason_not: str | None) -> AttentionDecision:
    """Attend decode and verify groups through the kernel or not, as `mode` says (see the module docstring);
    sets it on the model and returns the decision. `on` where it cannot apply raises ValueError naming why."""
    if mode == "off":
        return AttentionDecision(name, False, "model.cpu_decode_attention is off")
    try:
        if reason_not is not None:
            raise KernelUnavailable(reason_not)
        kernel = load()
        worst, gather_s, kernel_s = _check_and_time(model, kernel, timed=mode == "auto")
        if not worst <= _TOLERANCE:  # also catches NaN
            raise KernelUnavailable(f"the kernel disagrees with gather + SDPA by {worst:.3g} (tolerance "
                                    f"{_TOLERANCE:g}) on this host")
    except KernelUnavailable as e:
        if mode == "on":
            raise ValueError(f"model.cpu_decode_attention is on, but for the {name} model {e}") from e
        decision = AttentionDecision(name, False, str(e))
        log.info("cpu decode attention, %s: gather + SDPA (%s)", name, decision.reason)
        return decision
    if gather_s is None or kernel_s is None:
        model.set_decode_kernel(kernel)
        return AttentionDecision(name, True, f"model.cpu_decode_attention is on ({kernel.origin})")
    keep = kernel_s <= _KEEP_BELOW * gather_s
    if keep:
        model.set_decode_kernel(kernel)
    decision = AttentionDecision(
        name, keep, f"decode groups of 1 and 16 sequences: kernel {kernel_s * 1e3:.3f} ms ({kernel.origin}) vs "
        f"gather + SDPA {gather_s * 1e3:.3f} ms", gather_s * 1e3, kernel_s * 1e3)
    log.info("cpu decode attention, %s: %s (%s)", name, "kernel" if keep else "gather + SDPA", decision.reason)
    return decision


# (what, KV heads, query heads per KV head, head dim, sequences, context, query tokens per sequence)
COMPARE_SHAPES: tuple[tuple[str, int, int, int, int, int, int], ...] = (
    ("demo target, decode", 4, 2, 32, 1, 160, 1),
    ("demo target, decode", 4, 2, 32, 32, 160, 1),
    ("demo target, decode", 4, 2, 32, 64, 160, 1),
    ("demo target, verify 2", 4, 2, 32, 16, 160, 2),
    ("demo target, verify 3", 4, 2, 32, 16, 160, 3),
    ("demo target, verify 9", 4, 2, 32, 1, 160, 9),
    ("Qwen2.5-0.5B-like, decode", 2, 7, 64, 8, 2000, 1),
    ("Llama-8B-like, decode", 8, 4, 128, 16, 1024, 1),
    ("Llama-8B-like, decode", 8, 4, 128, 4, 4096, 1),
)


@dataclass
class Comparison:
    shape: str
    sequences: int
    context: int
    query: int
    this_ms: float  # one call over one layer, median of interleaved rounds
    other_ms: float
    max_difference: float  # largest |this - other| over the outputs

    @property
    def ratio(self) -> float:
        return self.this_ms / self.other_ms


def compare(other_source: Path, shapes: tuple[tuple[str, int, int, int, int, int, int], ...] = COMPARE_SHAPES,
            rounds: int = 15, calls: int = 3) -> list[Comparison]:
    """Build this kernel and `other_source` (another version of the .cpp, e.g. from `git show`) with the same
    compiler and flags, and time one call of each on each shape, interleaved (medians of `rounds` rounds of
    `calls` calls), over a random cache whose sequences' blocks are scattered. Raises KernelUnavailable where a
    build fails, FileNotFoundError where other_source is missing."""
    if not other_source.is_file():
        raise FileNotFoundError(f"no kernel source at {other_source}")
    this = DecodeAttentionKernel(build())  # as the engine builds it (cached)
    compiler = find_compiler()
    assert compiler is not None  # build() found one
    with tempfile.TemporaryDirectory(prefix="specdeploy-compare-") as tmp:
        other_path = Path(tmp) / "other.so"
        _compile(compiler, FLAGS, other_path, other_source)
        other = DecodeAttentionKernel(other_path, "other")
        generator = torch.Generator().manual_seed(0)
        return [_compare_shape(this, other, shape, generator, rounds, calls) for shape in shapes]


def _compare_shape(this: DecodeAttentionKernel, other: DecodeAttentionKernel,
                   shape: tuple[str, int, int, int, int, int, int], generator: torch.Generator, rounds: int,
                   calls: int) -> Comparison:
    """One shape of `compare`: a random cache holding exactly the sequences' blocks, in scattered order."""
    name, hkv, n_rep, dim, seqs, context, query = shape
    bs = 16
    per_seq = -(-context // bs)
    k = torch.randn(seqs * per_seq + 1, bs, hkv, dim, generator=generator) * 2
    v = torch.randn(seqs * per_seq + 1, bs, hkv, dim, generator=generator)
    tables = torch.randperm(k.shape[0], generator=generator)[: seqs * per_seq].view(seqs, per_seq)
    q = torch.randn(seqs * query, hkv * n_rep, dim, generator=generator)
    q_start = torch.full((seqs,), context - query, dtype=torch.int64)
    lens = torch.full((seqs,), context, dtype=torch.int64)
    scale = dim**-0.5
    difference = (this(q, k, v, tables, q_start, lens, n_rep, scale)
                  - other(q, k, v, tables, q_start, lens, n_rep, scale)).abs().max().item()

    def timed(kernel: DecodeAttentionKernel) -> Callable[[], float]:
        def run() -> float:
            start = time.perf_counter()
            for _ in range(calls):
                kernel(q, k, v, tables, q_start, lens, n_rep, scale)
            return (time.perf_counter() - start) / calls
        return run

    this_s, other_s = interleaved_medians([timed(this), timed(other)], rounds)
    return Comparison(name, seqs, context, query, this_s * 1e3, other_s * 1e3, difference)


def main(argv: list[str] | None = None) -> int:
    """`python -m serving.engine.kernels.cpu_attention prebuild DIR`: the portable builds, for an image's build stage.
    `python -m serving.engine.kernels.cpu_attention compare OTHER.cpp`: this kernel's time over another version's."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m serving.engine.kernels.cpu_attention")
    actions = parser.add_subparsers(dest="action", required=True)
    action = actions.add_parser("prebuild", help="compile the portable builds for this architecture into DIR")
    action.add_argument("directory", type=Path)
    action = actions.add_parser("compare", help="time this kernel against another version of its source, both "
                                "built for this CPU, interleaved on decode and verify shapes (one layer a call)")
    action.add_argument("other", type=Path, help="the other .cpp, e.g. git show REV:" + str(SOURCE.relative_to(
        Path(__file__).parents[3])) + " > FILE")
    action.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    args = parser.parse_args(argv)
    try:
        if args.action == "prebuild":
            for path in prebuild(args.directory):
                sys.stdout.write(f"{path}\n")
            return 0
        if args.rounds < 1:
            parser.exit(2, "error: --rounds must be at least 1\n")
        sys.stdout.write(f"{'shape':28} {'seqs':>5} {'context':>7} {'query':>5} {'this ms':>9} {'other ms':>9} "
                         f"{'this/other':>10} {'max diff':>9}\n")
        for c in compare(args.other, rounds=args.rounds):
            sys.stdout.write(f"{c.shape:28} {c.sequences:5d} {c.context:7d} {c.query:5d} {c.this_ms:9.3f} "
                             f"{c.other_ms:9.3f} {c.ratio:10.3f} {c.max_difference:9.1e}\n")
    except (KernelUnavailable, FileNotFoundError) as e:
        parser.exit(1, f"error: {e}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
