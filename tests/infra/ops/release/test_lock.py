"""The shared release lock and audit trail, on both backends: an S3 object with conditional writes
(loopback moto_server) and a Kubernetes Lease (the loopback stand-in API server)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infra.ops.release.audit import ConfigMapAudit, S3Audit
from infra.ops.release.kubernetes import KubeApi
from infra.ops.release.lock import (
    Conflict,
    Holder,
    KubeLease,
    LockBackend,
    LockHeld,
    S3Lock,
    SharedLock,
    break_lock,
    me,
)
from infra.ops.release.model import ReleaseError
from infra.ops.release.state import StateStore, StepLog

from .conftest import MODEL_BUCKET
from .test_kubernetes import FakeApiServer, serve_objects


@pytest.fixture
def kube() -> Iterator[FakeApiServer]:
    with serve_objects([]) as fake:
        yield fake


@pytest.fixture(params=["s3", "lease"])
def backend(request: pytest.FixtureRequest) -> LockBackend:
    if request.param == "s3":
        return S3Lock(request.getfixturevalue("s3"), MODEL_BUCKET, "prod")
    fake: FakeApiServer = request.getfixturevalue("kube")
    return KubeLease(KubeApi(fake.url, "test-token"), "specdeploy")


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))

    def kinds(self) -> list[str]:
        return [event for event, _ in self.events]


def holder(name: str, lease_s: float = 60.0) -> Holder:
    from dataclasses import replace

    return replace(me(f"specdeploy rollout --stack prod ({name})", lease_s), holder=name)


def test_second_holder_is_refused_with_the_first_ones_name(backend: LockBackend) -> None:
    first, second = Recorder(), Recorder()
    SharedLock(backend, holder("alice@laptop"), first).acquire()
    with pytest.raises(LockHeld) as refused:
        SharedLock(backend, holder("ci@runner"), second).acquire()
    message = str(refused.value)
    assert "held by alice@laptop (pid" in message and " since " in message and backend.where in message
    assert "specdeploy unlock --stack STACK --force" in message
    assert first.kinds() == ["lock_acquired"]
    assert second.kinds() == ["lock_refused"]
    assert second.events[0][1]["held_by"].startswith("alice@laptop")


def test_release_frees_the_lock_for_the_next_holder(backend: LockBackend) -> None:
    first = SharedLock(backend, holder("alice@laptop"), Recorder())
    first.acquire()
    first.release()
    assert backend.read() is None
    SharedLock(backend, holder("ci@runner"), Recorder()).acquire()
    current = backend.read()
    assert current is not None and current[0].holder == "ci@runner"


def test_expired_lease_is_taken_over_and_the_old_holder_loses_it(backend: LockBackend) -> None:
    old = SharedLock(backend, holder("alice@laptop", lease_s=0.3), Recorder())
    old.acquire()  # acquired, never renewed: a crashed process
    time.sleep(0.4)
    taker_audit = Recorder()
    SharedLock(backend, holder("ci@runner"), taker_audit).acquire()
    assert taker_audit.kinds() == ["lock_taken_over"]
    assert taker_audit.events[0][1]["expired_holder"].startswith("alice@laptop")
    # The old holder, back to life, cannot renew, must not move traffic, and does not delete the new lock.
    assert old.renew() is False
    with pytest.raises(ReleaseError, match="lock .* lost"):
        old.check()
    old.release()
    current = backend.read()
    assert current is not None and current[0].holder == "ci@runner"


def test_renewal_keeps_a_short_lease_alive_while_held(backend: LockBackend) -> None:
    lock = SharedLock(backend, holder("alice@laptop", lease_s=1.2), Recorder())
    with lock.held():
        time.sleep(2.5)  # two leases: without renewal (every 0.4 s) it would have expired
        with pytest.raises(LockHeld):
            SharedLock(backend, holder("ci@runner"), Recorder()).acquire()
        current = backend.read()
        assert current is not None and not current[0].expired()
    assert backend.read() is None


def test_forced_break_removes_a_live_lock_and_is_audited(backend: LockBackend) -> None:
    victim = SharedLock(backend, holder("alice@laptop"), Recorder())
    victim.acquire()
    audit = Recorder()
    broken = break_lock(backend, holder("bob@desk"), audit, "alice's laptop died")
    assert broken is not None and broken.holder == "alice@laptop"
    assert backend.read() is None
    ((event, fields),) = audit.events
    assert event == "lock_broken" and fields["holder"] == "bob@desk" and fields["reason"] == "alice's laptop died"
    assert fields["previous_holder"].startswith("alice@laptop") and fields["previous_expired"] is False
    assert victim.renew() is False and victim.lost
    assert break_lock(backend, holder("bob@desk"), audit, "again") is None  # nothing to break


def test_stale_version_cannot_replace_or_delete(backend: LockBackend) -> None:
    lock = SharedLock(backend, holder("alice@laptop"), Recorder())
    lock.acquire()
    current = backend.read()
    assert current is not None
    _, read_version = current
    assert lock.renew()  # the holder renews after someone read the lock
    with pytest.raises(Conflict):
        backend.delete(read_version)
    with pytest.raises(Conflict):
        backend.replace(holder("mallory@elsewhere"), read_version)
    with pytest.raises(Conflict):
        backend.create(holder("mallory@elsewhere"))


def test_racing_threads_one_winner(backend: LockBackend) -> None:
    """Eight acquirers at once: exactly one holds the lock, seven are told who does."""
    barrier = threading.Barrier(8)
    outcomes: list[str] = []

    def race(name: str) -> None:
        lock = SharedLock(backend, holder(name), Recorder())
        barrier.wait()
        try:
            lock.acquire()
            outcomes.append(f"won {name}")
        except LockHeld as exc:
            outcomes.append(f"refused: {exc.holder.holder}")

    threads = [threading.Thread(target=race, args=(f"op{i}@host",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    winners = [o for o in outcomes if o.startswith("won")]
    assert len(outcomes) == 8 and len(winners) == 1
    assert set(outcomes) - set(winners) == {f"refused: {winners[0].removeprefix('won ')}"}


def test_foreign_record_is_refused_with_a_clear_message(s3: Any) -> None:
    s3.put_object(Bucket=MODEL_BUCKET, Key="release-lock/prod.json", Body=b"not json")
    with pytest.raises(ReleaseError, match="not a specdeploy lock record .* unlock --force"):
        S3Lock(s3, MODEL_BUCKET, "prod").read()


def test_nonpositive_lease_is_refused() -> None:
    with pytest.raises(ReleaseError, match="lease 0s must be positive"):
        me("specdeploy rollout", 0)


# --- the audit trail ---------------------------------------------------------------------------


def test_s3_audit_is_one_object_per_event_in_time_order(s3: Any, tmp_path: Path) -> None:
    audit = S3Audit(s3, MODEL_BUCKET, "prod")
    log = StepLog(tmp_path / "prod.jsonl", "prod", audit, by="alice@laptop pid 1")
    for weight in (10, 50, 100):
        log.write("shift", weight=weight)
    log.write("guard_check", ok=True)  # local only: the audit trail keeps what operators act on
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=MODEL_BUCKET, Prefix="release-audit/prod/")["Contents"]]
    assert len(keys) == 3 and all(k.endswith("-shift.json") for k in keys)
    assert [r["weight"] for r in audit.read()] == [10, 50, 100]
    assert {r["by"] for r in audit.read()} == {"alice@laptop pid 1"}
    assert [r["event"] for r in log.read()] == ["shift", "shift", "shift", "guard_check"]


def test_unreachable_audit_does_not_stop_the_release(tmp_path: Path) -> None:
    class Broken:
        where = "s3://nowhere/release-audit/prod/"

        def append(self, record: dict[str, Any]) -> None:
            raise OSError("connection refused")

        def read(self) -> list[dict[str, Any]]:
            return []

    log = StepLog(tmp_path / "prod.jsonl", "prod", Broken())
    log.write("rollback", slot="blue")
    assert [(r["event"], r.get("of")) for r in log.read()] == [("rollback", None), ("audit_unwritten", "rollback")]
    assert "connection refused" in log.read()[1]["error"]


def test_configmap_audit_appends_from_concurrent_writers(kube: FakeApiServer) -> None:
    """Two writers at once: every event lands (replace with resourceVersion, retried on 409)."""
    barrier = threading.Barrier(2)

    def writer(offset: int) -> None:
        audit = ConfigMapAudit(KubeApi(kube.url, "test-token"), "specdeploy", attempts=50)
        barrier.wait()
        for i in range(10):
            audit.append({"ts": 1_800_000_000 + offset + i * 2 / 1000, "event": "shift", "n": offset * 100 + i})

    threads = [threading.Thread(target=writer, args=(n,)) for n in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    records = ConfigMapAudit(KubeApi(kube.url, "test-token"), "specdeploy").read()
    assert sorted(r["n"] for r in records) == sorted([*range(10), *range(100, 110)])
    assert [r["ts"] for r in records] == sorted(r["ts"] for r in records)


def test_store_stops_a_rollout_whose_lock_was_broken(s3: Any, tmp_path: Path) -> None:
    backend = S3Lock(s3, MODEL_BUCKET, "prod")
    store = StateStore(tmp_path, "prod", SharedLock(backend, holder("alice@laptop", lease_s=0.6), Recorder()))
    with store.exclusive():
        store.check_lock()
        break_lock(backend, holder("bob@desk"), Recorder(), "test")
        deadline = time.monotonic() + 15  # the renewal (every 0.2 s) finds the lock gone; slow on a busy machine
        while store.shared is not None and not store.shared.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(ReleaseError, match="lost"):
            store.check_lock()


def test_missing_bucket_names_the_bucket_and_the_option(s3: Any) -> None:
    lock = SharedLock(S3Lock(s3, "no-such-specdeploy-bucket", "prod"), holder("alice@laptop"), Recorder())
    with pytest.raises(ReleaseError, match="bucket no-such-specdeploy-bucket does not exist: pass --lock-bucket"):
        lock.acquire()
