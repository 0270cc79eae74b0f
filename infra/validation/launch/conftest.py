"""Launch validation: the guides' checklist against one running deployment.

    SPECDEPLOY_API_KEY=... pytest tests/launch -m launch --endpoint http://10.0.1.5:8000 \
        --stack prod --profile standard --hosts ssh://ubuntu@10.0.1.5 --report reports/prod

or ``specdeploy validate --stack NAME``. Without --endpoint every launch check is skipped (this
directory is also collected by the project's own test run). Expensive load (the concurrency
sweep, the sustained run, the speculative A/B) runs once per session in fixtures; the checks are
flat tests that each state one fact about those measurements, the endpoint or a host.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

from infra.validation.profiles import PROFILES, Profile, get_profile
from infra.validation.record import GROUPS, CheckOutcome, LaunchRun

API_KEY_ENV = "SPECDEPLOY_API_KEY"
_RUN_KEY = pytest.StashKey[LaunchRun]()
_PATHS_KEY = pytest.StashKey[dict[str, Path]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("launch", "specdeploy launch validation")
    group.addoption("--endpoint", default=None, help="base URL of the deployment (load balancer, ingress or server)")
    group.addoption("--stack", default="local", help="stack whose SLOs, limits and paths apply (default: local)")
    group.addoption("--profile", default="quick", choices=sorted(PROFILES), help="how long and hard to load it")
    group.addoption("--report", default=None, metavar="DIR", help="write report.html, report.json, summary.md here")
    group.addoption("--ab-endpoint", default=None,
                    help="other arm of the speculative A/B: the same deployment with speculative.enabled flipped "
                         "(e.g. the idle release slot); for local stacks the suite starts it itself")
    group.addoption("--model-dir", default=None, help="model version directory on the hosts (default: from the stack)")
    group.addoption("--sustained-s", type=float, default=None,
                    help="override the profile's sustained duration (seconds); for testing the checks themselves")


@dataclass(frozen=True)
class LaunchOptions:
    endpoint: str | None
    stack: str
    profile: Profile
    report: Path | None
    ab_endpoint: str | None
    model_dir: str | None


def launch_options(config: pytest.Config) -> LaunchOptions:
    report = config.getoption("report", None)
    profile = get_profile(config.getoption("profile", None) or "quick")
    sustained = config.getoption("sustained_s", None)
    if sustained:
        profile = replace(profile, sustained_s=sustained, sample_interval_s=min(profile.sample_interval_s,
                                                                                 sustained / 10))
    return LaunchOptions(
        endpoint=(config.getoption("endpoint", None) or "").rstrip("/") or None,
        stack=config.getoption("stack", None) or "local",
        profile=profile,
        report=Path(report) if report else None,
        ab_endpoint=config.getoption("ab_endpoint", None),
        model_dir=config.getoption("model_dir", None),
    )


def stack_config(config: pytest.Config) -> Any:
    from infra.config import load_stack

    return load_stack(launch_options(config).stack).config


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize from the stack and profile: one test per prompt set, level, alert series, model."""
    names = metafunc.fixturenames
    if not any(n in names for n in ("prompt_set", "sweep_level", "alert_series", "model_role", "ab_cell")):
        return
    options = launch_options(metafunc.config)
    config = stack_config(metafunc.config)
    profile = options.profile
    if "prompt_set" in names:
        from serving.demo.prompts import CATEGORIES

        metafunc.parametrize("prompt_set", CATEGORIES)
    if "sweep_level" in names:
        levels = profile.levels(profile.sweep_concurrency, config.scheduler.max_concurrency,
                                config.slo.target_concurrency)
        metafunc.parametrize("sweep_level", levels, ids=[f"c{c}" for c in levels])
    if "alert_series" in names:
        from infra.alerts import alert_rules

        pairs = sorted({(rule.name, series) for rule in alert_rules(config) for series in rule.server_metrics})
        metafunc.parametrize("alert_series", pairs, ids=[f"{r}-{s}" for r, s in pairs])
    if "model_role" in names:
        metafunc.parametrize("model_role", ["target", "draft"] if config.draft is not None else ["target"])
    if "ab_cell" in names:
        levels = profile.levels(profile.ab_concurrency, config.scheduler.max_concurrency,
                                config.slo.target_concurrency)
        cells = [(ps, c) for ps in profile.ab_prompt_sets for c in levels]
        metafunc.parametrize("ab_cell", cells, ids=[f"{ps}-c{c}" for ps, c in cells])


# --- the run record and the report ----------------------------------------------------------------


def _group_of(nodeid: str) -> str:
    module = Path(nodeid.split("::", 1)[0]).stem.removeprefix("test_")
    return module if module in GROUPS else "other"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    run = _stashed_run()
    if run is None:
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        message = ""
        if report.skipped and isinstance(report.longrepr, tuple):
            message = str(report.longrepr[2])
        elif report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            message = crash.message if crash is not None else (report.longreprtext.strip()[-500:] or "failed")
        run.checks.append(CheckOutcome(report.nodeid, _group_of(report.nodeid), report.outcome, message,
                                       report.duration))


# The configs of the sessions in this process (one, unless pytest runs pytest): the report hook
# receives no config, so it finds the run record through them.
_SESSION_CONFIG: list[pytest.Config] = []


def pytest_configure(config: pytest.Config) -> None:
    # Registered here too: from an installed package the suite runs without the repository's pytest config.
    config.addinivalue_line("markers", "launch: launch validation against a running deployment")
    _SESSION_CONFIG.append(config)
    if launch_options(config).endpoint is not None:
        _use_default_hosts(config)


def _use_default_hosts(config: pytest.Config) -> None:
    """Without --hosts, the stack's serving hosts (runner.default_hosts) become --hosts, which
    testinfra's `host` fixture is parametrized by: this machine for a local process,
    ``podman://<container>`` for the local container runtime. For ``podman://`` hosts, `podman exec`
    gets the project's podman storage and configuration unless the environment names its own."""
    from infra.validation.runner import container_environment, default_hosts

    if getattr(config.option, "hosts", None) is None:
        hosts = default_hosts(launch_options(config).stack)
        if hosts:
            config.option.hosts = ",".join(hosts)
    for key, value in container_environment(host_specs(config)).items():
        os.environ.setdefault(key, value)


def pytest_unconfigure(config: pytest.Config) -> None:
    if config in _SESSION_CONFIG:
        _SESSION_CONFIG.remove(config)


def _stashed_run() -> LaunchRun | None:
    for config in _SESSION_CONFIG:
        run = config.stash.get(_RUN_KEY, None)
        if run is not None:
            return run
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without --endpoint there is no deployment to check: the launch checks are deselected (the
    project's own test run collects this directory too; test_ci_quick.py brings its own deployment)."""
    if launch_options(config).endpoint is not None:
        return
    launch = [item for item in items if item.get_closest_marker("launch") is not None]
    if launch:
        config.hook.pytest_deselected(items=launch)
        items[:] = [item for item in items if item.get_closest_marker("launch") is None]


def pytest_collection_finish(session: pytest.Session) -> None:
    options = launch_options(session.config)
    if options.endpoint is None:
        return
    config = stack_config(session.config)
    from infra.validation.loadgen import SloTargets
    from infra.validation.report import served_by

    run = LaunchRun(stack=options.stack, endpoint=options.endpoint, profile=options.profile.name,
                    slo=config.slo.model_dump(), targets=SloTargets.from_stack(config.slo),
                    target_concurrency=min(config.slo.target_concurrency, config.scheduler.max_concurrency),
                    warmup_fraction=options.profile.warmup_fraction, server=served_by(options.stack),
                    hosts=host_specs(session.config))
    session.config.stash[_RUN_KEY] = run


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    run = session.config.stash.get(_RUN_KEY, None)
    options = launch_options(session.config)
    if run is None or options.report is None:
        return
    from infra.validation.report import write_report

    run.finished_at = time.time()
    session.config.stash[_PATHS_KEY] = write_report(run, options.report)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    run = config.stash.get(_RUN_KEY, None)
    if run is None:
        return
    counts = run.counts()
    terminalreporter.section("specdeploy launch validation")
    terminalreporter.write_line(f"verdict: {'PASS' if run.passed else 'FAIL'} ({counts['passed']} passed, "
                                f"{counts['failed']} failed, {counts['skipped']} skipped)")
    if run.recommendation is not None:
        rec = run.recommendation
        terminalreporter.write_line(f"speculative decoding: {'enable' if rec['enabled'] else 'disable'} "
                                    f"({rec['reason']})")
    paths = config.stash.get(_PATHS_KEY, None)
    if paths:
        terminalreporter.write_line(f"report: {paths['html']}")


# --- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def options(request: pytest.FixtureRequest) -> LaunchOptions:
    return launch_options(request.config)


@pytest.fixture(scope="session")
def endpoint(options: LaunchOptions) -> str:
    if options.endpoint is None:
        pytest.skip("no --endpoint: launch checks run against a deployment (specdeploy validate --stack NAME)")
    return options.endpoint


@pytest.fixture(scope="session")
def launch_run(request: pytest.FixtureRequest, endpoint: str) -> LaunchRun:
    return request.config.stash[_RUN_KEY]


@pytest.fixture(scope="session")
def stack(request: pytest.FixtureRequest) -> Any:
    """The validated StackConfig of --stack."""
    return stack_config(request.config)


@pytest.fixture(scope="session")
def profile(options: LaunchOptions) -> Profile:
    return options.profile


@pytest.fixture(scope="session")
def api_key() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


@pytest.fixture(scope="session")
def http(endpoint: str, api_key: str | None) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=endpoint, headers=headers, timeout=300) as client:
        yield client


@pytest.fixture(scope="session")
def model_name(http: httpx.Client) -> str:
    response = http.get("/v1/models")
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


@pytest.fixture(scope="session")
def server_port(endpoint: str, stack: Any) -> int:
    """The port the server process listens on: the endpoint's own for a local stack (the endpoint
    is the server), the stack's service.port behind a load balancer or ingress."""
    if stack.platform == "local":
        parsed = urlparse(endpoint)
        return parsed.port or (443 if parsed.scheme == "https" else 80)
    return int(stack.service.port)


@pytest.fixture(scope="session")
def listen_address(stack: Any) -> str:
    """Where the server must listen: loopback for the local platform, all interfaces of a private
    instance or pod otherwise (the security group / NetworkPolicy is the boundary there)."""
    return str(stack.local.host) if stack.platform == "local" else "0.0.0.0"


def host_specs(config: pytest.Config) -> list[str]:
    """Testinfra backends of the serving hosts: --hosts (set from the stack when not given, see
    ``_use_default_hosts``); none for a cloud stack without --hosts."""
    return [s for s in (config.getoption("hosts", None) or "").split(",") if s]


def container_of(hosts: list[str]) -> str | None:
    """The container name when the one serving host is a podman container (``podman://[user@]NAME``)."""
    if len(hosts) == 1 and hosts[0].startswith("podman://"):
        return hosts[0].removeprefix("podman://").rpartition("@")[2]
    return None


@pytest.fixture(scope="session")
def serving_hosts(request: pytest.FixtureRequest, stack: Any) -> list[str]:
    """Testinfra backends of the serving hosts (``host_specs``). A cloud stack without --hosts has no
    host to inspect (the operator's machine is not one)."""
    hosts = host_specs(request.config)
    if not hosts:
        pytest.skip(f"{stack.platform} stack and no --hosts: pass the serving hosts (ssh://..., kubectl://pod?...)")
    return hosts


@pytest.fixture(autouse=True)
def _host_checks_need_a_serving_host(request: pytest.FixtureRequest) -> None:
    if "host" in request.fixturenames:
        request.getfixturevalue("serving_hosts")


@dataclass(frozen=True)
class ServerFacts:
    pid: int | None  # the process listening on the server port
    oom_kills: int | None  # OOM kills so far in its memory cgroup; None where unreadable


@pytest.fixture(scope="session")
def server_facts(serving_hosts: list[str], server_port: int) -> Any:
    """A function returning {testinfra host spec: ServerFacts now} for the serving hosts."""
    import testinfra

    from infra.validation.hostfacts import oom_kills, server_pid

    def current() -> dict[str, ServerFacts]:
        facts = {}
        for spec in serving_hosts:
            host = testinfra.get_host(spec)
            pid = server_pid(host, server_port)
            facts[spec] = ServerFacts(pid, None if pid is None else oom_kills(host, pid))
        return facts

    return current


@pytest.fixture(scope="session")
def server_facts_before_load(server_facts: Any) -> dict[str, ServerFacts]:
    return dict(server_facts())


# --- load: each measured once per session ----------------------------------------------------------


@pytest.fixture(scope="session")
def workloads(profile: Profile) -> list[Any]:
    from infra.validation.loadgen import load_workloads

    return load_workloads(max_tokens=profile.max_tokens)


@pytest.fixture(scope="session")
def sweep(launch_run: LaunchRun, endpoint: str, api_key: str | None, profile: Profile, stack: Any,
          workloads: list[Any], server_facts_before_load: dict[str, ServerFacts]) -> dict[int, Any]:
    """Closed-loop phases at each concurrency level of the profile, all prompt sets mixed."""
    from infra.validation import phases

    levels = profile.levels(profile.sweep_concurrency, stack.scheduler.max_concurrency, stack.slo.target_concurrency)
    measured = phases.sweep(endpoint, api_key, profile, levels, workloads)
    launch_run.sweep = list(measured.values())
    return measured


@pytest.fixture(scope="session")
def open_loop(launch_run: LaunchRun, sweep: dict[int, Any], endpoint: str, api_key: str | None, profile: Profile,
              workloads: list[Any]) -> Any:
    """Poisson arrivals at 80 % of the request rate the sweep measured at target concurrency."""
    from infra.validation import phases

    capacity = sweep[launch_run.target_concurrency].summary()["request_throughput_rps"]
    launch_run.open_loop = phases.open_loop(endpoint, api_key, profile, capacity, workloads)
    return launch_run.open_loop


@pytest.fixture(scope="session")
def sustained(launch_run: LaunchRun, endpoint: str, api_key: str | None, profile: Profile,
              workloads: list[Any], server_facts_before_load: dict[str, ServerFacts]) -> Any:
    """Closed loop at the SLO's target concurrency for the profile's sustained duration."""
    from infra.validation import phases

    launch_run.sustained = phases.sustained(endpoint, api_key, profile, launch_run.target_concurrency, workloads)
    return launch_run.sustained


@pytest.fixture(scope="session")
def ab_arms(request: pytest.FixtureRequest, options: LaunchOptions, endpoint: str, api_key: str | None, stack: Any,
            server_port: int, launch_run: LaunchRun,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    """(spec-on endpoint, spec-off endpoint, how they were obtained) for the A/B."""
    from infra.validation.phases import is_speculating

    deployed_on = is_speculating(endpoint, api_key)
    if options.ab_endpoint:
        other = options.ab_endpoint.rstrip("/")
        if is_speculating(other, api_key) == deployed_on:
            pytest.fail(f"--ab-endpoint {other} has speculation {'on' if deployed_on else 'off'} like --endpoint")
        method = "two servers given on the command line (--endpoint, --ab-endpoint), same build and weights"
        yield (endpoint, other, method) if deployed_on else (other, endpoint, method)
        return
    if stack.platform != "local":
        pytest.skip("no --ab-endpoint: on a cloud stack fill the idle release slot with speculation flipped "
                    "and pass its URL")
    flipped = "false" if deployed_on else "true"
    container = container_of(host_specs(request.config))
    if container is not None:
        yield from _container_ab_arms(container, flipped, deployed_on, endpoint, launch_run, tmp_path_factory)
        return
    import testinfra

    from infra.validation.hostfacts import server_pid
    from infra.validation.twin import start_process_twin

    pid = server_pid(testinfra.get_host("local://"), server_port)
    if pid is None:
        pytest.skip(f"cannot tell which local process serves port {server_port}")
    twin = _twin_or_skip(start_process_twin, pid, flipped, tmp_path_factory)
    method = (f"two servers on this host: the deployed one and a twin started from its config file and "
              f"environment with only SPECDEPLOY__SPECULATIVE__ENABLED={flipped} (port {twin.port}); the "
              f"server has no runtime switch, and a twin changes exactly one setting. Phases alternate ABBA, "
              f"one server loaded at a time")
    yield from _arms_with_twin(twin, method, deployed_on, endpoint, launch_run)


def _twin_or_skip(start_twin: Any, deployed: Any, flipped: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A twin of the deployed server (process or container) with only speculation flipped, or a skip saying why."""
    from infra.validation.twin import TwinUnavailable

    log = tmp_path_factory.mktemp("ab") / "twin.log"
    try:
        return start_twin(deployed, {"SPECDEPLOY__SPECULATIVE__ENABLED": flipped}, log)
    except TwinUnavailable as exc:
        pytest.skip(f"no A/B possible: {exc}")


def _arms_with_twin(twin: Any, method: str, deployed_on: bool, endpoint: str,
                    launch_run: LaunchRun) -> Iterator[tuple[str, str, str]]:
    """(spec-on endpoint, spec-off endpoint, method) while the twin runs; the twin stops afterwards."""
    launch_run.notes.append(f"A/B: {method}.")
    try:
        yield (endpoint, twin.endpoint, method) if deployed_on else (twin.endpoint, endpoint, method)
    finally:
        twin.stop()


def _container_ab_arms(container: str, flipped: str, deployed_on: bool, endpoint: str, launch_run: LaunchRun,
                       tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    """The A/B of a server in a container: a twin container of the same image, mounts and settings."""
    from infra.validation.twin import start_container_twin

    twin = _twin_or_skip(start_container_twin, container, flipped, tmp_path_factory)
    method = (f"two containers on this host: the deployed {container} and a twin of the same image, mounts "
              f"and settings with only SPECDEPLOY__SPECULATIVE__ENABLED={flipped} ({twin.endpoint}); the server "
              f"has no runtime switch, and a twin changes exactly one setting. Phases alternate ABBA, one server "
              f"loaded at a time")
    yield from _arms_with_twin(twin, method, deployed_on, endpoint, launch_run)


@pytest.fixture(scope="session")
def ab_result(launch_run: LaunchRun, ab_arms: tuple[str, str, str], api_key: str | None, profile: Profile,
              stack: Any) -> Any:
    from infra.validation.phases import speculative_ab

    on_url, off_url, method = ab_arms
    levels = profile.levels(profile.ab_concurrency, stack.scheduler.max_concurrency, stack.slo.target_concurrency)
    result = speculative_ab(on_url, off_url, api_key, profile, levels, method)
    launch_run.ab = result
    recommendation = result.recommendation(launch_run.target_concurrency)
    # The stack's speculative section as it should read: only `enabled` is the A/B's to decide.
    recommendation["config"] = {**stack.speculative.model_dump(), "enabled": recommendation["enabled"]}
    launch_run.recommendation = recommendation
    return result
