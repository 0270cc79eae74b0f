"""serving/Dockerfile as text: one check per defect the first real build found, and the entrypoint command.

The built image itself is checked in tests/serving/image/ (podman, `make image`).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DOCKERFILE = (REPO / "serving" / "Dockerfile").read_text()
IGNORE_FILE = (REPO / "serving" / "Dockerfile.dockerignore").read_text()


def _instructions(name: str, text: str = DOCKERFILE) -> list[str]:
    joined = re.sub(r"\\\n", " ", text)
    return [line.split(None, 1)[1] for line in joined.splitlines() if line.startswith(name + " ")]


def _stage(name: str) -> str:
    """The text of one build stage (from its FROM to the next FROM)."""
    match = re.search(rf"^FROM \S+ AS {name}\n(.*?)(?=^FROM |\Z)", DOCKERFILE, re.MULTILINE | re.DOTALL)
    assert match, f"no stage {name}"
    return match.group(1)


# ---- defect 1: the CPU base is Python 3.11 (the only CPU torch wheel the machines carry is cp311) ----

def test_default_base_is_python_3_11() -> None:
    (default,) = re.findall(r"^ARG BASE_IMAGE=(\S+)$", DOCKERFILE, re.MULTILINE)
    assert re.search(r"python:3\.11-slim", default), default
    assert "python:3.12" not in DOCKERFILE


# ---- defect 2: no ARG-named stages (podman 4.3 cannot resolve them; docker's builder builds them all) ----

def test_every_from_is_the_base_argument_or_an_earlier_stage() -> None:
    froms = _instructions("FROM")
    stages: list[str] = []
    for instruction in froms:
        image, _, stage = instruction.partition(" AS ")
        assert image == "${BASE_IMAGE}" or image in stages, f"FROM {instruction}: not the base argument"
        stages.append(stage.strip())
    assert stages == ["build", "runtime"]


def test_runtime_takes_the_virtualenv_and_the_source_from_the_build_stage_only() -> None:
    copies = _instructions("COPY", _stage("runtime"))
    assert copies == ["--from=build /opt/specdeploy /opt/specdeploy", "--from=build /opt/app /opt/specdeploy/app"]


# ---- defect 3: the torch index is a build argument, never baked into the image ----

def test_torch_index_is_an_arg_not_an_env() -> None:
    assert any(a.startswith("TORCH_INDEX_URL") for a in _instructions("ARG"))
    assert not any("TORCH_INDEX_URL" in e for e in _instructions("ENV"))
    # empty → pip's own configuration decides (a local wheel directory), no unreachable index retried
    assert '${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}' in DOCKERFILE


# ---- defect 4: dependencies in their own layer, before the source ----

def test_dependencies_install_before_the_source_is_copied() -> None:
    build = _stage("build")
    first_install = build.index("pip install")
    copy_source = build.index("COPY serving")
    assert first_install < copy_source
    assert "pip install" not in build[copy_source:], "a pip install after the source reinstalls on any edit"
    runtime = _stage("runtime")  # the virtualenv copy must not change when only the source does
    assert runtime.index("COPY --from=build /opt/specdeploy ") < runtime.index("COPY --from=build /opt/app ")
    assert "COPY pyproject.toml" in build[:first_install]


# ---- defect 5: SPECDEPLOY_CONFIG is what selects the config ----

def test_config_comes_from_the_environment_variable() -> None:
    assert "SPECDEPLOY_CONFIG=/etc/specdeploy/server.yaml" in " ".join(_instructions("ENV"))
    assert not _instructions("CMD"), "a CMD with --config overrides SPECDEPLOY_CONFIG"
    assert "--config" not in _instructions("ENTRYPOINT")[-1]


# ---- defect 7: no frontend fetched from a registry; the run example gives the drain time ----

def test_no_syntax_directive_and_run_example_has_a_stop_timeout() -> None:
    assert not re.search(r"^#\s*syntax=", DOCKERFILE, re.MULTILINE)
    run_example = re.search(r"^#\s+docker run (?:.*\\\n)*.*$", DOCKERFILE, re.MULTILINE)
    assert run_example, "no `docker run` example"
    run_example = run_example.group(0)
    assert "--stop-timeout" in run_example


# ---- defect 8: the server alone, no infra/ ----

def test_image_carries_serving_only() -> None:
    copies = " ".join(_instructions("COPY"))
    assert "infra" not in copies and "tests" not in copies
    assert _instructions("ENTRYPOINT")[-1] == '["python3", "-m", "serving"]'
    included = [line.strip() for line in IGNORE_FILE.splitlines() if line.strip().startswith("!")]
    assert included == ["!pyproject.toml", "!serving/**"]
    assert "serving/demo/**" in IGNORE_FILE.splitlines()


def test_installs_core_and_serve_dependencies_only() -> None:
    assert "p['optional-dependencies']['serve']" in DOCKERFILE
    assert "'infra'" not in DOCKERFILE and "'dev'" not in DOCKERFILE


# ---- the rest of the contract ----

def test_runs_as_a_non_root_user() -> None:
    users = _instructions("USER")
    assert users and users[-1].split(":")[0] not in ("root", "0")


def test_healthcheck_probes_health() -> None:
    (check,) = _instructions("HEALTHCHECK")
    assert "/health" in check and "--start-period" in check


def test_entrypoint_command_starts_fast_and_documents_itself() -> None:
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "serving", "--help"], capture_output=True, text=True, timeout=60,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "--config" in result.stdout and "SIGTERM" in result.stdout
    assert time.monotonic() - started < 20


def test_entrypoint_without_config_fails_with_one_line(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "serving"], capture_output=True, text=True, timeout=60, env=env,
                            cwd=REPO)
    assert result.returncode == 2
    assert result.stderr.strip().endswith("error: no config file: pass --config FILE or set SPECDEPLOY_CONFIG")


def test_entrypoint_reads_the_config_named_by_the_environment(tmp_path: Path) -> None:
    config = tmp_path / "server.yaml"
    config.write_text("model: {path: /m}\nscheduler: {max_queue: -1}\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SPECDEPLOY_CONFIG": str(config)}
    result = subprocess.run([sys.executable, "-m", "serving"], capture_output=True, text=True, timeout=60, env=env,
                            cwd=REPO)
    assert result.returncode == 2
    assert "scheduler.max_queue" in result.stderr
