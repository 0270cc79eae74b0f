"""The release lock through the command: two `specdeploy rollout` processes against one loopback
moto_server, `specdeploy unlock`, and a Kubernetes Lease held by someone else."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from infra.config import project_dir
from infra.ops.cli.main import main
from infra.ops.release.audit import ConfigMapAudit, S3Audit
from infra.ops.release.kubernetes import KubeApi
from infra.ops.release.lock import KubeLease, S3Lock, SharedLock, me

from .conftest import MODEL_BUCKET, AwsRelease, SlotServer
from .test_kubernetes import FakeApiServer, k8s, serve_objects


def rollout_process(aws: AwsRelease, stacks: Path, slot: SlotServer, who: str, state: str) -> subprocess.Popen[str]:
    """`specdeploy rollout` as its own process, as another operator's machine would run it (own state dir)."""
    # As the `specdeploy` script does (`-m infra.ops.cli.main` would run a second copy of the module as __main__).
    entry = "import sys; from infra.ops.cli.main import main; sys.exit(main(sys.argv[1:]))"
    command = [sys.executable, "-c", entry, "rollout", "--stack", "prod", "--to", "green",
               "--stacks-dir", str(stacks), "--state-dir", str(stacks.parent / state), "--slot-endpoint", slot.url,
               "--skip-validation", "--steps", "50,100", "--observe", "4s", "--poll", "0.2s", *aws.cli_args()]
    env = {**os.environ, "SPECDEPLOY_LOCK_HOLDER": who}
    return subprocess.Popen(command, cwd=project_dir(), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.slow
def test_two_rollout_processes_one_wins_the_other_names_it(aws_release: AwsRelease, s3: Any, prod_copy: Path,
                                                           slot_server: SlotServer) -> None:
    processes = {who: rollout_process(aws_release, prod_copy, slot_server, who, f"state-{who.split('@')[0]}")
                 for who in ("alice@laptop", "pipeline@ci")}
    results = {who: (p.wait(timeout=120), *p.communicate(timeout=10)) for who, p in processes.items()}
    winners = [who for who, (code, _, _) in results.items() if code == 0]
    assert len(winners) == 1, results
    (loser,) = set(results) - set(winners)
    code, _, err = results[loser]
    assert code == 2, results
    assert f"held by {winners[0]} (pid {processes[winners[0]].pid}" in err
    assert f"since {time.strftime('%Y-%m-%d', time.gmtime())}" in err
    assert aws_release.weights() == {"blue": 0, "green": 100}  # the winner finished its rollout
    # The bucket's audit trail records both: the winner's whole release, the loser's refusal.
    audit = S3Audit(s3, MODEL_BUCKET, "prod").read()
    by_winner = [r["event"] for r in audit if r["by"] == f"{winners[0]} pid {processes[winners[0]].pid}"]
    assert by_winner[0] == "lock_acquired" and by_winner[-1] == "lock_released"
    assert by_winner.count("shift") == 2 and "done" in by_winner
    refused = [r for r in audit if r["event"] == "lock_refused"]
    assert len(refused) == 1 and refused[0]["holder"] == loser
    assert refused[0]["held_by"].startswith(f"{winners[0]} (pid {processes[winners[0]].pid}")
    assert S3Lock(s3, MODEL_BUCKET, "prod").read() is None  # released at the end


def unlock(aws: AwsRelease, stacks: Path, *extra: str) -> int:
    return main(["unlock", "--stack", "prod", "--stacks-dir", str(stacks), "--state-dir", str(stacks.parent / "state"),
                 *extra])


def test_unlock_names_the_holder_and_breaks_only_with_force(aws_release: AwsRelease, s3: Any, prod_copy: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    backend = S3Lock(s3, MODEL_BUCKET, "prod")
    crashed = replace(me("specdeploy rollout --stack prod --to green"), holder="alice@laptop", pid=4242)
    SharedLock(backend, crashed, lambda *a, **k: None).acquire()
    assert unlock(aws_release, prod_copy) == 1
    out = capsys.readouterr().out
    assert "held by alice@laptop (pid 4242, `specdeploy rollout --stack prod --to green`) since" in out
    assert "(live)" in out and backend.read() is not None  # nothing removed without --force

    assert unlock(aws_release, prod_copy, "--force", "--reason", "alice's laptop died mid-rollout") == 0
    out = capsys.readouterr().out
    assert "broke the lock of alice@laptop (pid 4242" in out and "stops before its next traffic step" in out
    assert backend.read() is None
    (broken,) = [r for r in S3Audit(s3, MODEL_BUCKET, "prod").read() if r["event"] == "lock_broken"]
    assert broken["reason"] == "alice's laptop died mid-rollout"
    assert broken["previous_holder"].startswith("alice@laptop (pid 4242")
    assert unlock(aws_release, prod_copy) == 0 and "free" in capsys.readouterr().out


def test_rollout_takes_over_an_expired_lock_and_says_whose(aws_release: AwsRelease, s3: Any, prod_copy: Path,
                                                           slot_server: SlotServer) -> None:
    backend = S3Lock(s3, MODEL_BUCKET, "prod")
    SharedLock(backend, replace(me("specdeploy rollback --stack prod", 0.2), holder="alice@laptop"),
               lambda *a, **k: None).acquire()
    time.sleep(0.3)
    assert main(["rollout", "--stack", "prod", "--to", "green", "--stacks-dir", str(prod_copy), "--state-dir",
                 str(prod_copy.parent / "state"), "--slot-endpoint", slot_server.url, "--skip-validation",
                 "--steps", "100", "--observe", "0.2s", "--poll", "0.1s", *aws_release.cli_args()]) == 0
    (taken,) = [r for r in S3Audit(s3, MODEL_BUCKET, "prod").read() if r["event"] == "lock_taken_over"]
    assert taken["expired_holder"].startswith("alice@laptop")
    assert backend.read() is None


# --- Kubernetes: the Lease in the stack's namespace ------------------------------------------------


@pytest.fixture
def api_server() -> Iterator[FakeApiServer]:
    """The stand-in API server with the k8s-prod routing objects (rendered once per module)."""
    with serve_objects(_rendered()) as fake:
        yield fake


_RENDERED: list[dict[str, Any]] = []


def _rendered() -> list[dict[str, Any]]:
    if not _RENDERED:
        from infra.ops.k8s_render import render_objects
        from infra.program.preview import record_stack

        _RENDERED.extend(render_objects((r.type, r.inputs) for r in record_stack("k8s-prod").resources))
    return _RENDERED


def test_live_lease_refuses_a_kubernetes_rollout_before_any_patch(
        api_server: FakeApiServer, kubeconfig: Path, prod_copy: Path, slot_server: SlotServer,
        capsys: pytest.CaptureFixture[str]) -> None:
    api = KubeApi(api_server.url, "test-token")
    SharedLock(KubeLease(api, "specdeploy"), replace(me("specdeploy rollout --stack k8s-prod --to green"),
                                                     holder="pipeline@ci", pid=77), lambda *a, **k: None).acquire()
    assert k8s("rollout", prod_copy, kubeconfig, "--to", "green", "--slot-endpoint", slot_server.url,
               "--observe", "0.2s", "--poll", "0.1s", "--skip-validation") == 2
    err = capsys.readouterr().err
    assert "held by pipeline@ci (pid 77" in err and "Lease specdeploy/specdeploy-release" in err
    assert api_server.patches() == []
    (refused,) = ConfigMapAudit(api, "specdeploy").read()
    assert refused["event"] == "lock_refused" and refused["held_by"].startswith("pipeline@ci (pid 77")
    lease = api_server.objects["/apis/coordination.k8s.io/v1/namespaces/specdeploy/leases/specdeploy-release"]
    assert lease["spec"]["holderIdentity"] == "pipeline@ci pid 77"


def test_kubernetes_rollout_holds_the_lease_and_audits_in_a_configmap(
        api_server: FakeApiServer, kubeconfig: Path, prod_copy: Path, slot_server: SlotServer) -> None:
    seen: list[dict[str, Any]] = []

    def watch() -> None:  # the Lease as another operator would see it mid-rollout
        path = "/apis/coordination.k8s.io/v1/namespaces/specdeploy/leases/specdeploy-release"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not seen:
            if api_server.patches() and path in api_server.objects:
                seen.append(json.loads(json.dumps(api_server.objects[path])))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    assert k8s("rollout", prod_copy, kubeconfig, "--to", "green", "--steps", "50,100", "--slot-endpoint",
               slot_server.url, "--observe", "0.5s", "--poll", "0.1s", "--skip-validation") == 0
    watcher.join(timeout=5)
    assert seen and seen[0]["spec"]["holderIdentity"].endswith(f"pid {os.getpid()}")
    assert seen[0]["spec"]["leaseDurationSeconds"] == 120
    assert "/apis/coordination.k8s.io/v1/namespaces/specdeploy/leases/specdeploy-release" not in api_server.objects
    events = [r["event"] for r in ConfigMapAudit(KubeApi(api_server.url, "test-token"), "specdeploy").read()]
    assert events[0] == "lock_acquired" and events[-1] == "lock_released"
    assert events.count("shift") == 2 and "done" in events


def test_kubernetes_rollout_stops_before_the_next_shift_when_its_lease_is_broken(
        api_server: FakeApiServer, kubeconfig: Path, prod_copy: Path, slot_server: SlotServer,
        capsys: pytest.CaptureFixture[str]) -> None:
    def break_after_first_shift() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not api_server.patches():
            time.sleep(0.02)
        assert main(["unlock", "--stack", "k8s-prod", "--stacks-dir", str(prod_copy), "--state-dir",
                     str(prod_copy.parent / "state"), "--kubeconfig", str(kubeconfig), "--force"]) == 0

    breaker = threading.Thread(target=break_after_first_shift, daemon=True)
    breaker.start()
    assert k8s("rollout", prod_copy, kubeconfig, "--to", "green", "--steps", "10,50,100", "--slot-endpoint",
               slot_server.url, "--observe", "1.5s", "--poll", "0.1s", "--skip-validation",
               "--lock-lease", "0.6s") == 2
    breaker.join(timeout=10)
    assert "release lock Lease specdeploy/specdeploy-release lost" in capsys.readouterr().err
    assert len(api_server.patches()) == 1  # the 10 % step only; nothing moved after the break
    events = [r["event"] for r in ConfigMapAudit(KubeApi(api_server.url, "test-token"), "specdeploy").read()]
    assert "lock_broken" in events and "lock_lost" in events


def test_rollback_is_refused_while_another_release_holds_the_lock(aws_release: AwsRelease, s3: Any,
                                                                  prod_copy: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    aws_release.set_weights({"blue": 50, "green": 50})
    SharedLock(S3Lock(s3, MODEL_BUCKET, "prod"), replace(me("specdeploy rollout --stack prod --to green"),
                                                         holder="pipeline@ci", pid=77), lambda *a, **k: None).acquire()
    assert main(["rollback", "--stack", "prod", "--stacks-dir", str(prod_copy), "--state-dir",
                 str(prod_copy.parent / "state"), *aws_release.cli_args()]) == 2
    assert "held by pipeline@ci (pid 77, `specdeploy rollout --stack prod --to green`)" in capsys.readouterr().err
    assert aws_release.count("ModifyListener") == 0 and aws_release.weights() == {"blue": 50, "green": 50}
    (refused,) = [r for r in S3Audit(s3, MODEL_BUCKET, "prod").read() if r["event"] == "lock_refused"]
    assert refused["command"] == "specdeploy rollback --stack prod"
