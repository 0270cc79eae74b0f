"""The import rules of docs/ARCHITECTURE.md, checked with `ast` over every module of infra/ and serving/.

"Module level" is every import that runs when the module is imported: anything outside a function
body, except under ``if TYPE_CHECKING:``. Function-level imports run only in the command that needs
them, which is how the CLI stays light and how `specdeploy bench` may reach the engine.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("infra", "serving")
PULUMI = ("pulumi", "pulumi_aws", "pulumi_kubernetes", "pulumi_policy")
# Where Pulumi may be imported at module level: the program (its offline preview included, which
# runs the program under Pulumi's mocks), its components and the policy pack.
PULUMI_HOMES = ("infra/program/", "infra/components/", "infra/policy/")
# The benchmarks and their harness: the one place in infra/ that imports torch and the engine at module level.
BENCH_HOME = "infra/bench/"


@dataclass(frozen=True)
class Import:
    module: str  # absolute dotted name; `from a import b` yields both a and a.b
    line: int
    module_level: bool  # runs on import (not inside a function, not under TYPE_CHECKING)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str, is_package: bool = False) -> list[Import]:
    """Every import statement in ``source`` (the text of ``module``), relative ones made absolute."""
    found: list[Import] = []
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST, module_level: bool) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            module_level = False
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for statement in node.body:
                visit(statement, False)
            for statement in node.orelse:
                visit(statement, module_level)
            return
        if isinstance(node, ast.Import):
            found.extend(Import(alias.name, node.lineno, module_level) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append(Import(base, node.lineno, module_level))
            found.extend(Import(f"{base}.{alias.name}", node.lineno, module_level)
                         for alias in node.names if alias.name != "*")
        for child in ast.iter_child_nodes(node):
            visit(child, module_level)

    visit(ast.parse(source), True)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@dataclass(frozen=True)
class Module:
    path: str  # relative to the repository, with forward slashes
    imports: tuple[Import, ...]


def _modules(root: Path = REPO) -> Iterator[Module]:
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            name = _module_name(path, root)
            imports = imports_of(path.read_text(encoding="utf-8"), name, path.name == "__init__.py")
            yield Module(path.relative_to(root).as_posix(), tuple(imports))


MODULES = list(_modules())


def rules_broken(path: str, imp: Import) -> list[str]:
    """The rules one import of the module at ``path`` breaks."""
    in_serving, in_infra = path.startswith("serving/"), path.startswith("infra/") and not path.startswith(BENCH_HOME)
    broken = []
    if path.startswith("serving/engine/") and _within(imp.module, ("fastapi", "starlette", "serving.api")):
        broken.append("the engine knows no HTTP")
    if in_serving and _within(imp.module, ("infra",)):
        broken.append("serving/ never imports infra/ (the server image carries no infra/)")
    if in_serving and _within(imp.module, PULUMI):
        broken.append("serving/ never imports Pulumi (the server image carries none)")
    if not imp.module_level:
        return broken
    if in_infra and _within(imp.module, ("torch", "transformers")):
        broken.append("infra/ never imports torch or transformers at module level")
    if in_infra and _within(imp.module, ("serving.engine", "serving.api")):
        broken.append("infra/ reaches the engine and the HTTP server only inside the serve/bench functions")
    if in_infra and _within(imp.module, ("infra.bench",)):
        broken.append("infra/ reaches infra/bench/ only inside the bench command's functions")
    if _within(imp.module, PULUMI) and not path.startswith(PULUMI_HOMES):
        broken.append("Pulumi is imported at module level only by the program, components and policy")
    return broken


def violations(modules: list[Module]) -> list[str]:
    """Each broken rule as 'path:line: rule (import)'."""
    found: dict[tuple[str, int, str], str] = {}  # one entry per statement and rule
    for module in modules:
        for imp in module.imports:
            for rule in rules_broken(module.path, imp):
                found.setdefault((module.path, imp.line, rule), f"{module.path}:{imp.line}: {rule} ({imp.module})")
    return list(found.values())


def test_every_package_is_scanned() -> None:
    paths = {m.path for m in MODULES}
    assert {"serving/engine/engine.py", "serving/main.py", "infra/config/__init__.py", "infra/program/aws.py"} <= paths


def test_the_tree_keeps_the_import_rules() -> None:
    assert violations(MODULES) == []


# The checker itself, on made-up modules: each rule must be able to fail.

def _module(path: str, source: str) -> Module:
    name = _module_name(REPO / path, REPO)
    return Module(path, tuple(imports_of(source, name, path.endswith("__init__.py"))))


@pytest.mark.parametrize(("path", "source", "rule"), [
    ("serving/engine/x.py", "import fastapi\n", "the engine knows no HTTP"),
    ("serving/engine/x.py", "def f():\n    from starlette.requests import Request\n", "the engine knows no HTTP"),
    ("serving/engine/spec/x.py", "from ...api import routes\n", "the engine knows no HTTP"),
    ("serving/engine/x.py", "from serving import api\n", "the engine knows no HTTP"),
    ("serving/cli.py", "def serve():\n    from infra.config import load_stack\n", "serving/ never imports infra/"),
    ("serving/x.py", "import pulumi\n", "serving/ never imports Pulumi"),
    ("infra/capacity.py", "import torch\n", "never imports torch or transformers"),
    ("infra/ops/x.py", "try:\n    from transformers import AutoConfig\nexcept ImportError:\n    pass\n",
     "never imports torch or transformers"),
    ("infra/ops/cli/x.py", "from serving.engine.engine import LLMEngine\n", "only inside the serve/bench functions"),
    ("infra/config.py", "import pulumi\n", "Pulumi is imported at module level only"),
    ("infra/ops/release/x.py", "import pulumi_aws as aws\n", "Pulumi is imported at module level only"),
    ("serving/api/x.py", "def f():\n    from infra.bench import engine\n", "serving/ never imports infra/"),
    ("infra/ops/cli/x.py", "from infra.bench import engine\n", "only inside the bench command's functions"),
    ("infra/validation/x.py", "from infra.bench import http\n", "only inside the bench command's functions"),
    ("infra/bench/x.py", "import pulumi\n", "Pulumi is imported at module level only"),
])
def test_the_checker_catches(path: str, source: str, rule: str) -> None:
    found = violations([_module(path, source)])
    assert any(rule in f for f in found) and all(f.startswith(f"{path}:") for f in found), found


@pytest.mark.parametrize(("path", "source"), [
    ("infra/ops/cli/bench_cmd.py", "def run():\n    from infra.bench.engine import bench\n    import torch\n"),
    ("infra/bench/x.py", "import torch\nfrom serving.engine import engine\nfrom infra.bench import step_profile\n"),
    ("infra/program/preview.py", "import pulumi\n"),
    ("infra/components/aws/x.py", "import pulumi_aws as aws\n"),
    ("infra/ops/x.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"),
    ("infra/alerts.py", "from serving import metric_names\n"),
    ("serving/engine/x.py", "from serving.stats import percentile\n"),
])
def test_the_checker_allows(path: str, source: str) -> None:
    assert violations([_module(path, source)]) == []


# ---- The server image carries no benchmark, no infra/ and no demo ----------------------------------------
# Its build context is the tree filtered by serving/Dockerfile.dockerignore, computed here from the patterns.

IGNORE_FILE = REPO / "serving" / "Dockerfile.dockerignore"
# Words in a module's name that say it measures rather than serves: such a module lives in infra/bench/.
BENCH_WORDS = ("bench", "profile", "gpu_check")


def benchmark_modules(paths: Iterable[str]) -> list[str]:
    """The modules under serving/ among ``paths`` whose name (or a package's name above them) says benchmark."""
    return [path for path in paths if path.startswith("serving/") and path.endswith(".py")
            and any(word in part for part in path.removesuffix(".py").split("/")[1:] for word in BENCH_WORDS)]


@dataclass(frozen=True)
class IgnoreRule:
    pattern: str
    keep: bool  # a `!` line: puts back what an earlier line left out
    regex: re.Pattern[str]


def _glob(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex: `**` spans any number of folders, `*` and `?` stay within one."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] in "*?":
            out, i = out + ("[^/]*" if pattern[i] == "*" else "[^/]"), i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def ignore_rules(text: str) -> list[IgnoreRule]:
    """The lines of a .dockerignore file, in order; comments and blank lines dropped."""
    rules = []
    for line in (raw.strip() for raw in text.splitlines()):
        if line and not line.startswith("#"):
            pattern = line.removeprefix("!").strip("/")
            rules.append(IgnoreRule(pattern, line.startswith("!"), _glob(pattern)))
    return rules


def in_context(path: str, rules: list[IgnoreRule]) -> bool:
    """Whether the build context keeps ``path``: the last rule that matches it or one of the folders above it
    decides (a rule on a folder covers what is in it, as in Docker's matcher); no rule, kept."""
    parts = path.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    kept = True
    for rule in rules:
        if any(rule.regex.match(candidate) for candidate in candidates):
            kept = rule.keep
    return kept


def build_context(root: Path, rules: list[IgnoreRule]) -> Iterator[str]:
    """Every file under ``root`` the build context keeps, relative with forward slashes. A folder left out,
    with no `!` rule that reaches inside it (.venv, .git), is not walked."""
    reopened = [re.split(r"[*?\[]", rule.pattern)[0] for rule in rules if rule.keep]

    def walk(folder: str) -> bool:
        prefix = folder + "/"
        return in_context(folder, rules) or any(p.startswith(prefix) or prefix.startswith(p) for p in reopened)

    for directory, folders, files in os.walk(root):
        here = Path(directory).relative_to(root).as_posix()
        here = "" if here == "." else here + "/"
        folders[:] = [f for f in folders if walk(here + f)]
        yield from (here + f for f in files if in_context(here + f, rules))


def test_no_module_under_serving_is_a_benchmark() -> None:
    assert benchmark_modules(m.path for m in MODULES) == []


def test_the_image_context_has_no_infra_no_demo_and_no_benchmark() -> None:
    context = list(build_context(REPO, ignore_rules(IGNORE_FILE.read_text())))
    assert {"pyproject.toml", "serving/main.py", "serving/engine/engine.py"} <= set(context)
    assert [f for f in context if f.startswith(("infra/", "serving/demo/"))] == []
    assert benchmark_modules(context) == []


# The two checks above, on made-up names and ignore files: each must be able to fail.

@pytest.mark.parametrize("path", [
    "serving/engine/benchmark.py", "serving/engine/spec/benchmark.py", "serving/api/bench.py",
    "serving/engine/step_profile.py", "serving/engine/gpu_check.py", "serving/bench/x.py",
])
def test_a_benchmark_named_module_under_serving_is_caught(path: str) -> None:
    assert benchmark_modules([path]) == [path]


@pytest.mark.parametrize("path", ["serving/engine/engine.py", "infra/bench/engine.py", "serving/demo/README.md"])
def test_a_serving_module_or_a_bench_outside_serving_passes(path: str) -> None:
    assert benchmark_modules([path]) == []


SERVING_ONLY = "**\n!pyproject.toml\n!serving/**\nserving/demo/**\n**/__pycache__\n"


@pytest.mark.parametrize(("ignore", "path", "kept"), [
    (SERVING_ONLY, "serving/engine/engine.py", True),
    (SERVING_ONLY, "pyproject.toml", True),
    (SERVING_ONLY, "infra/bench/engine.py", False),
    (SERVING_ONLY, "serving/demo/models/target/model.safetensors", False),
    (SERVING_ONLY, "serving/api/__pycache__/app.cpython-311.pyc", False),
    ("**\n!serving/**\n", "serving/demo/train_target.py", True),  # without its line the demo ships
    ("*.md\n", "README.md", False),
    ("*.md\n", "docs/engine.md", True),  # `*` stays within the top folder
    ("docs\n", "docs/benchmarks/log.md", False),  # a rule on a folder covers what is in it
])
def test_the_context_matcher_reads_the_patterns_as_docker_does(ignore: str, path: str, kept: bool) -> None:
    assert in_context(path, ignore_rules(ignore)) is kept


def test_the_context_walk_finds_a_file_the_ignore_file_lets_in(tmp_path: Path) -> None:
    for path in ("serving/x.py", "serving/demo/y.py", "infra/z.py", ".venv/lib/w.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    assert sorted(build_context(tmp_path, ignore_rules(SERVING_ONLY))) == ["serving/x.py"]
    assert sorted(build_context(tmp_path, ignore_rules("**\n!serving/**\n!infra/**\n"))) == [
        "infra/z.py", "serving/demo/y.py", "serving/x.py"]


# ---- infra/'s layers: every infra module imports only from its own layer or the layers below ----------
#
# Top to bottom. Module level and function level alike: a function-level import still ties the lower
# layer to the upper one (a launch check that imports the operator CLI cannot run without it).
INFRA_LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ops", ("infra.ops",)),  # the specdeploy CLI, the local platform, blue/green release
    ("bench", ("infra.bench",)),  # the benchmarks and their harness
    ("validation", ("infra.validation",)),  # the launch checks
    ("policy", ("infra.policy",)),  # the policy pack, over the program's recorded resources
    ("program", ("infra.program", "infra.__main__")),  # the Pulumi program and its offline preview
    ("components", ("infra.components",)),  # one ComponentResource per file
    ("runtime", ("infra.runtime",)),  # servers on this machine: processes, containers, podman
    ("domain", ("infra.capacity", "infra.catalog", "infra.alerts", "infra.offerings")),
    ("config", ("infra.config",)),  # the stack config package: the schema every layer reads
)


def infra_layer(module: str) -> int | None:
    """The rank of ``module``'s layer, 0 the top; None for infra itself and anything outside infra."""
    for rank, (_, prefixes) in enumerate(INFRA_LAYERS):
        if _within(module, prefixes):
            return rank
    return None


def layer_breaks(path: str, imp: Import) -> str | None:
    """The layer rule ``imp`` (in the module at ``path``) breaks, if it reaches upward."""
    if not path.startswith("infra/"):
        return None
    here, there = infra_layer(_module_name(REPO / path, REPO)), infra_layer(imp.module)
    if here is None or there is None or there >= here:
        return None
    return f"infra/ imports downward only: {INFRA_LAYERS[here][0]} may not import {INFRA_LAYERS[there][0]}"


def layer_violations(modules: list[Module]) -> list[str]:
    found: dict[tuple[str, int], str] = {}
    for module in modules:
        for imp in module.imports:
            rule = layer_breaks(module.path, imp)
            if rule is not None:
                found.setdefault((module.path, imp.line), f"{module.path}:{imp.line}: {rule} ({imp.module})")
    return list(found.values())


def test_every_infra_module_has_a_layer() -> None:
    unplaced = [m.path for m in MODULES if m.path.startswith("infra/") and m.path != "infra/__init__.py"
                and infra_layer(_module_name(REPO / m.path, REPO)) is None]
    assert unplaced == []


def test_infra_imports_follow_the_layer_order() -> None:
    assert layer_violations(MODULES) == []


@pytest.mark.parametrize(("path", "source", "rule"), [
    ("infra/policy/offline.py", "from infra.ops.preview import RecordedResource\n", "policy may not import ops"),
    ("infra/validation/runner.py", "def key():\n    from infra.ops.local import LocalDeployment\n",
     "validation may not import ops"),
    ("infra/validation/launch/conftest.py", "def twin():\n    from ...ops import local_container\n",
     "validation may not import ops"),
    ("infra/runtime/process.py", "from infra.validation import hostfacts\n", "runtime may not import validation"),
    ("infra/config/x.py", "from infra.capacity import plan\n", "config may not import domain"),
    ("infra/components/aws/x.py", "from infra.program.aws_args import AwsArgs\n",
     "components may not import program"),
])
def test_the_layer_checker_catches(path: str, source: str, rule: str) -> None:
    found = layer_violations([_module(path, source)])
    assert len(found) == 1 and rule in found[0] and found[0].startswith(f"{path}:"), found


@pytest.mark.parametrize(("path", "source"), [
    ("infra/ops/cli/x.py", "def run():\n    from infra.validation import run_validation\n"),
    ("infra/validation/runner.py", "from infra.runtime.state import local_paths\n"),
    ("infra/policy/offline.py", "from infra.program.preview import RecordedResource\n"),
    ("infra/ops/release/x.py", "from infra.config import other_slot\n"),
    ("infra/validation/x.py", "from infra.validation.stats import percentile\n"),
])
def test_the_layer_checker_allows(path: str, source: str) -> None:
    assert layer_violations([_module(path, source)]) == []


# ---- The engine: proposers are driven through their protocol, and kernels live in one folder ----------------
#
# Read from each module's syntax tree, in infra/ and serving/ alike.

SPEC = "serving/engine/spec/"
KERNELS = "serving/engine/kernels/"
NATIVE_SUFFIXES = (".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp")
TORCH_LIBRARY_OPS = ("custom_op", "triton_op", "define", "impl", "Library")
# torch.library ops outside kernels/ that are no kernel: compile.py's only marks where inductor partitions a
# compiled step around attention (graph_partition); its body calls the model's own attention.
GRAPH_BOUNDARY_OPS = {"serving/engine/compile.py": ("specdeploy::attention",)}


def _dotted(node: ast.expr) -> str:
    """`a.b.c` for a name or an attribute chain; empty for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def proposer_classes(root: Path = REPO) -> set[str]:
    """Every proposer class: a class of serving/engine/spec/ that defines `propose` or derives from Proposer."""
    names = set()
    for path in sorted((root / SPEC).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and (
                any(isinstance(item, ast.FunctionDef) and item.name == "propose" for item in node.body)
                or any(_dotted(base).rpartition(".")[2] == "Proposer" for base in node.bases)
            ):
                names.add(node.name)
    return names


PROPOSERS = proposer_classes()


def _type_names(node: ast.expr) -> list[str]:
    """The class names an isinstance's second argument lists: a (dotted) name, a tuple, or an X | Y union."""
    if isinstance(node, ast.Tuple):
        return [name for element in node.elts for name in _type_names(element)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _type_names(node.left) + _type_names(node.right)
    return [_dotted(node).rpartition(".")[2]]


def engine_rules_broken(path: str, source: str, proposers: set[str] = PROPOSERS) -> list[str]:
    """Each place in the module at ``path`` that checks a proposer's type outside spec/ or defines, loads or
    names a kernel outside kernels/, as 'path:line: rule (what)'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and not path.startswith(SPEC):
            checked = _dotted(node.func) in ("isinstance", "issubclass") and len(node.args) == 2
            named = sorted(set(_type_names(node.args[1])) & proposers) if checked else []
            if named:
                found.append(f"{path}:{node.lineno}: the engine drives proposers through the Proposer protocol "
                             f"and its hooks; only spec/ may check a proposer's type ({', '.join(named)})")
        if path.startswith(KERNELS):
            continue
        what = ""
        if isinstance(node, ast.Attribute) and _dotted(node).endswith("triton.jit"):
            what = "a Triton kernel"
        elif isinstance(node, ast.Call):
            called = _dotted(node.func)
            first = node.args[0] if node.args else None
            op = first.value if isinstance(first, ast.Constant) else None
            if (called.startswith("torch.library.") and called.rpartition(".")[2] in TORCH_LIBRARY_OPS
                    and op not in GRAPH_BOUNDARY_OPS.get(path, ())):
                what = f"a torch.library op ({op})"
            elif called in ("ctypes.CDLL", "ctypes.cdll.LoadLibrary", "torch.ops.load_library") or \
                    "cpp_extension." in called:
                what = f"native code loaded ({called})"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                node.value == "csrc" or node.value.endswith(NATIVE_SUFFIXES)):
            what = f"a kernel source named ({node.value})"
        if what:
            found.append(f"{path}:{node.lineno}: kernels live in {KERNELS} only: {what}")
    return found


def test_the_engine_keeps_proposers_behind_their_protocol_and_kernels_in_one_folder() -> None:
    assert {"Proposer", "DraftModelProposer", "NgramProposer"} <= PROPOSERS
    found = [rule for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))
             for rule in engine_rules_broken(path.relative_to(REPO).as_posix(), path.read_text(encoding="utf-8"))]
    assert found == []


def test_native_kernel_sources_live_in_the_kernels_csrc_folder() -> None:
    sources = [path.relative_to(REPO).as_posix() for package in PACKAGES for path in (REPO / package).rglob("*")
               if path.suffix in NATIVE_SUFFIXES]
    assert sources and all(path.startswith(f"{KERNELS}csrc/") for path in sources), sources


@pytest.mark.parametrize(("path", "source", "rule"), [
    ("serving/engine/engine.py", "def f(p):\n    return isinstance(p, DraftModelProposer)\n", "Proposer protocol"),
    ("serving/engine/build.py", "isinstance(p, (int, spec.ngram.NgramProposer))\n", "Proposer protocol"),
    ("infra/bench/spec.py", "if isinstance(p, Proposer | None):\n    pass\n", "Proposer protocol"),
    ("serving/engine/model.py", "@triton.jit\ndef k(x):\n    pass\n", "a Triton kernel"),
    ("serving/engine/compile.py", "@torch.library.custom_op('specdeploy::gemm', mutates_args=())\ndef g(x):\n"
     "    return x\n", "a torch.library op (specdeploy::gemm)"),
    ("serving/engine/model.py", "lib = ctypes.CDLL(path)\n", "native code loaded"),
    ("infra/bench/x.py", "from torch.utils import cpp_extension\ncpp_extension.load_inline('k', src)\n",
     "native code loaded"),
    ("serving/engine/x.py", "SOURCE = Path(__file__).parent / 'csrc' / 'k.cpp'\n", "a kernel source named"),
])
def test_the_engine_checker_catches(path: str, source: str, rule: str) -> None:
    found = engine_rules_broken(path, source)
    assert found and all(rule in f and f.startswith(f"{path}:") for f in found), found


@pytest.mark.parametrize(("path", "source"), [
    ("serving/engine/spec/speculator.py", "isinstance(p, DraftModelProposer)\n"),
    ("serving/engine/engine.py", "isinstance(x, (int, Speculator))\n"),
    ("serving/engine/kernels/x.py", "@triton.jit\ndef k(x):\n    pass\nlib = ctypes.CDLL(Path('csrc') / 'k.so')\n"),
    ("serving/engine/compile.py", "@torch.library.custom_op('specdeploy::attention', mutates_args=())\ndef a(q):\n"
     "    return q\n"),
    ("serving/engine/model.py", "from serving.engine.kernels import cpu_attention\nk = cpu_attention.load()\n"),
])
def test_the_engine_checker_allows(path: str, source: str) -> None:
    assert engine_rules_broken(path, source) == []


# ---- One request path: admit → run → respond, one way ---------------------------------------------------------

# The steps in order: a step imports the step before it and no other (a walk through them visits no file twice);
# the endpoints' renderers belong to respond and are reached from it alone; a route calls the steps, no other route.
REQUEST_PATH = ("serving.api.admit", "serving.api.run", "serving.api.respond")
RENDERERS = "serving.api.render"
ROUTES = "serving.api.routes"


def _step(module: str) -> int | None:
    if _within(module, (RENDERERS,)):
        return REQUEST_PATH.index("serving.api.respond")
    return REQUEST_PATH.index(module) if module in REQUEST_PATH else None


def request_path_breaks(path: str, imp: Import) -> str | None:
    """The request path's rule one import of the module at ``path`` breaks (module and function level)."""
    module = _module_name(REPO / path, REPO)
    step, target = _step(module), _step(imp.module) if imp.module != RENDERERS else None
    if step is not None and target is not None and target != step and target != step - 1:
        return f"{module} imports {imp.module}: a step of admit → run → respond imports only the step before it"
    if _within(imp.module, (RENDERERS,)) and imp.module != RENDERERS and step != len(REQUEST_PATH) - 1:
        return f"{module} imports {imp.module}: an endpoint's renderer is reached from serving/api/respond.py alone"
    if _within(module, (ROUTES,)) and _within(imp.module, (ROUTES,)) and imp.module not in (ROUTES, module):
        return f"{module} imports {imp.module}: a route calls admit → run → respond, never another route"
    return None


def test_the_request_path_runs_one_way() -> None:
    assert all(any(m.path == name.replace(".", "/") + ".py" for m in MODULES) for name in REQUEST_PATH)
    broken = [f"{m.path}:{imp.line}: {rule}" for m in MODULES if m.path.startswith("serving/api/")
              for imp in m.imports if (rule := request_path_breaks(m.path, imp)) is not None]
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize(("path", "imported"), [
    ("serving/api/admit.py", "serving.api.run"),
    ("serving/api/admit.py", "serving.api.respond"),
    ("serving/api/run.py", "serving.api.respond"),
    ("serving/api/respond.py", "serving.api.admit"),
    ("serving/api/run.py", "serving.api.render.chat"),
    ("serving/api/render/chat.py", "serving.api.admit"),
    ("serving/api/routes/chat.py", "serving.api.render.chat"),
    ("serving/api/routes/responses.py", "serving.api.routes.chat"),
])
def test_the_request_path_checker_catches(path: str, imported: str) -> None:
    assert request_path_breaks(path, Import(imported, 1, False)) is not None


@pytest.mark.parametrize(("path", "imported"), [
    ("serving/api/run.py", "serving.api.admit"),
    ("serving/api/respond.py", "serving.api.run"),
    ("serving/api/respond.py", "serving.api.render.chat"),
    ("serving/api/render/chat.py", "serving.api.render.tool_calls"),
    ("serving/api/render/responses.py", "serving.api.run"),
    ("serving/api/routes/chat.py", "serving.api.respond"),
    ("serving/main.py", "serving.api.routes.chat"),
])
def test_the_request_path_checker_allows(path: str, imported: str) -> None:
    assert request_path_breaks(path, Import(imported, 1, True)) is None


# ---- One definition per limit ----------------------------------------------------------------------------------
# Every limit of the server config (a numeric field of its sections) and every sampling bound (serving/engine/
# types.py) is given its value in one place; everything else borrows it (section_field, the section's default,
# the constant's name). Walked with `ast` over infra/ and serving/: a class field, a function parameter's default
# or an assignment that gives one of those names a number, and a number too large to be a coincidence (>= 2**24:
# the CPU KV budget, the seed range) written out again, are definitions.

SAMPLING_BOUNDS_HOME = "serving/engine/types.py"
DISTINCT = 2**24
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "logprobs",
                   "top_logprobs")


def server_limits() -> dict[str, float]:
    """Each numeric field of the server config's sections, by name, with its default."""
    from serving.config import ServerConfig

    limits: dict[str, float] = {}
    for section in ServerConfig.model_fields.values():
        model = section.annotation
        assert isinstance(model, type)
        for name, field in model.model_fields.items():  # type: ignore[attr-defined]
            if isinstance(field.default, int | float) and not isinstance(field.default, bool):
                limits[name] = field.default
    return limits


def number(node: ast.AST | None) -> float | None:
    """The value of a numeric literal expression (2**20, -(2**63), 256 * 2**20), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = number(node.operand)
        return None if value is None else -value
    if isinstance(node, ast.BinOp):
        left, right = number(node.left), number(node.right)
        ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
               ast.Pow: lambda a, b: a**b, ast.LShift: lambda a, b: int(a) << int(b)}
        op = ops.get(type(node.op))
        return None if left is None or right is None or op is None else op(left, right)
    return None


def named_numbers(tree: ast.AST) -> Iterator[tuple[str, float, int]]:
    """(name, value, line) of every name given a number: assignments, class fields (pydantic's Field(default, ...)
    too) and parameter defaults."""
    for node in ast.walk(tree):
        pairs: list[tuple[str, ast.expr | None]] = []
        if isinstance(node, ast.Assign):
            pairs = [(t.id if isinstance(t, ast.Name) else t.attr, node.value) for t in node.targets
                     if isinstance(t, ast.Name | ast.Attribute)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            pairs = [(node.target.id, node.value)]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args.posonlyargs + node.args.args
            pairs = [(a.arg, d) for a, d in zip(args[len(args) - len(node.args.defaults):], node.args.defaults,
                                                 strict=True)]
            pairs += [(a.arg, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults, strict=True)]
        for name, value in pairs:
            if isinstance(value, ast.Call) and _dotted(value.func).rpartition(".")[2] == "Field":
                value = value.args[0] if value.args else None
            found = number(value)
            if found is not None:
                yield name, found, getattr(node, "lineno", 0)


def distinct_numbers(tree: ast.AST) -> Iterator[tuple[float, int]]:
    """(value, line) of every outermost numeric literal expression of at least DISTINCT."""
    def visit(node: ast.AST) -> Iterator[tuple[float, int]]:
        value = number(node) if isinstance(node, ast.Constant | ast.UnaryOp | ast.BinOp) else None
        if value is not None:
            if abs(value) >= DISTINCT:
                yield value, getattr(node, "lineno", 0)
            return
        for child in ast.iter_child_nodes(node):
            yield from visit(child)

    yield from visit(tree)


def limit_definitions(sources: dict[str, str], limits: dict[str, float], bounds: dict[str, float]
                      ) -> list[str]:
    """Each limit or bound given its value in more than one module, as 'what: path:line, path:line'."""
    places: dict[str, list[str]] = {}
    values = {v for v in [*limits.values(), *bounds.values()] if abs(v) >= DISTINCT}
    for path, source in sources.items():
        tree = ast.parse(source)
        for name, value, line in named_numbers(tree):
            # 0 starts a counter (SpecStats.num_draft_tokens), it bounds nothing
            if (name in limits or name in bounds) and value != 0:
                places.setdefault(name, []).append(f"{path}:{line}")
        for value, line in distinct_numbers(tree):
            if value in values:
                places.setdefault(f"the number {value:g}", []).append(f"{path}:{line}")
    return [f"{what} is defined in {', '.join(where)}" for what, where in places.items()
            if len({w.partition(':')[0] for w in where}) > 1]


def sampling_bounds(source: str) -> dict[str, float]:
    """The module-level bounds of serving/engine/types.py, each of a range's ends by the range's name."""
    bounds: dict[str, float] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
            if isinstance(value, ast.Tuple) and all(number(e) is not None for e in value.elts):
                bounds.update({f"{name}[{i}]": number(e) for i, e in enumerate(value.elts)})  # type: ignore[misc]
            elif number(value) is not None:
                bounds[name] = number(value)  # type: ignore[assignment]
    return bounds


def _sources() -> dict[str, str]:
    return {p.relative_to(REPO).as_posix(): p.read_text(encoding="utf-8")
            for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))}


def test_every_limit_and_sampling_bound_is_defined_once() -> None:
    sources = _sources()
    bounds = sampling_bounds(sources[SAMPLING_BOUNDS_HOME])
    assert {"MAX_LOGPROBS", "SEED_RANGE[1]", "TEMPERATURE_RANGE[1]", "PENALTY_RANGE[0]"} <= set(bounds)
    names = {name.partition("[")[0] for name in bounds}
    limits = server_limits()
    assert {"max_concurrency", "max_batched_tokens", "header_timeout_s", "max_unauthenticated_connections"} <= set(
        limits)
    assert not (found := limit_definitions(sources, limits, bounds | dict.fromkeys(names, 1.0))), "\n".join(found)


def test_the_sampling_schemas_and_validate_take_the_bounds_by_name() -> None:
    """No sampling field's bound is a literal in the request schemas, nor in SamplingParams.validate (0 aside)."""
    broken = []
    schemas = ast.parse((REPO / "serving/api/schemas.py").read_text(encoding="utf-8"))
    for node in ast.walk(schemas):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in SAMPLING_FIELDS \
                and isinstance(node.value, ast.Call):
            broken += [f"schemas.py:{node.lineno}: {node.target.id} {k.arg}={ast.unparse(k.value)}"
                       for k in node.value.keywords if k.arg in ("ge", "gt", "le", "lt") and number(k.value) not in
                       (None, 0)]
    types = ast.parse((REPO / SAMPLING_BOUNDS_HOME).read_text(encoding="utf-8"))
    validate = next(n for n in ast.walk(types) if isinstance(n, ast.FunctionDef) and n.name == "validate")
    indices = {id(n.slice) for n in ast.walk(validate) if isinstance(n, ast.Subscript)}  # RANGE[1] is no bound
    broken += [f"types.py:{n.lineno}: SamplingParams.validate bounds with the literal {ast.unparse(n)}"
               for n in ast.walk(validate) if isinstance(n, ast.Constant) and number(n) not in (None, 0)
               and id(n) not in indices]
    assert not broken, "\n".join(broken)


def test_the_engine_config_takes_the_server_configs_names() -> None:
    """A field EngineConfig borrows from a server config section keeps its name (the model directory aside:
    the engine's `model` is the model section's `path`)."""
    tree = ast.parse((REPO / "serving/engine/config.py").read_text(encoding="utf-8"))
    renamed = [f"{node.target.id} borrows {ast.unparse(node.value)}" for node in ast.walk(tree)
               if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
               and isinstance(node.value, ast.Call) and _dotted(node.value.func) == "section_field"
               and node.value.args[1].value != node.target.id  # type: ignore[attr-defined]
               and (node.target.id, node.value.args[1].value) != ("model", "path")]  # type: ignore[attr-defined]
    assert not renamed, renamed


def test_the_dtype_choices_are_written_once() -> None:
    """The precisions (fp32, fp16, bf16) are listed as choices in serving/config.py alone; the rest borrow them."""
    found = set()
    for path, source in _sources().items():
        for node in ast.walk(ast.parse(source)):
            items = node.elts if isinstance(node, ast.Tuple | ast.List) else None
            if isinstance(node, ast.Subscript) and _dotted(node.value).endswith("Literal"):
                items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            strings = {i.value for i in items or [] if isinstance(i, ast.Constant) and isinstance(i.value, str)}
            if {"fp32", "bf16"} <= strings:
                found.add(f"{path}:{getattr(node, 'lineno', 0)}")
    assert len(found) == 1 and found.pop().startswith("serving/config.py:"), found


@pytest.mark.parametrize(("source", "what"), [
    ("class Limits:\n    body_timeout_s: float = 30.0\n", "body_timeout_s"),
    ("def serve(max_concurrency=64):\n    pass\n", "max_concurrency"),
    ("class Local(BaseModel):\n    max_queue: int = Field(32, ge=0)\n", "max_queue"),
    ("MAX_LOGPROBS = 20\n", "MAX_LOGPROBS"),
    ("engine = EngineConfig(kv_cache_bytes=256 * 2**20)\n", "the number 2.68435e+08"),
])
def test_the_limit_walk_catches_a_second_definition(source: str, what: str) -> None:
    sources = {"serving/config.py": "class Scheduler:\n    max_concurrency: int = Field(64)\n"
                                    "    max_queue: int = Field(128)\n    body_timeout_s: float = 30.0\n"
                                    "KV = 256 * 2**20\n",
               "serving/engine/types.py": "MAX_LOGPROBS = 20\n", "infra/x.py": source}
    limits = {"max_concurrency": 64, "max_queue": 128, "body_timeout_s": 30.0, "kv_cache_bytes": 256 * 2**20}
    found = limit_definitions(sources, limits, {"MAX_LOGPROBS": 20})
    assert any(f.startswith(f"{what} is defined in") and "infra/x.py:" in f for f in found), found


@pytest.mark.parametrize("source", [
    "class Spec:\n    max_queue: int = section_field(SchedulerSection, 'max_queue')\n",
    "engine = EngineConfig(max_concurrency=8, kv_cache_bytes=CPU_KV_CACHE_BYTES)\n",
    "class Stats:\n    max_queue: int = 0\n",
    "chunk = 1 << 20\n",
])
def test_the_limit_walk_lets_a_borrowed_value_pass(source: str) -> None:
    sources = {"serving/config.py": "class Scheduler:\n    max_queue: int = Field(128)\nKV = 256 * 2**20\n",
               "infra/x.py": source}
    assert limit_definitions(sources, {"max_queue": 128, "max_concurrency": 64}, {}) == []
