"""One release of a stack at a time, across machines: a lease held in what the stack already owns.

* AWS: one object, ``s3://<model bucket>/release-lock/<stack>.json``, created with a conditional
  write (``If-None-Match: *``) so only one creator wins; renewed and released with ``If-Match``
  on its ETag, so nobody overwrites a lock they did not read.
* Kubernetes: a ``coordination.k8s.io/v1`` Lease ``specdeploy-release`` in the stack's namespace:
  create (409 = someone holds it), replace with the ``resourceVersion`` read, delete with it as a
  precondition.

Both hold the same record (:class:`Holder`: who, which process, which command, since when, until
when). A lease that is not renewed expires; an expired lease is taken over by the next rollout
(audited), a live one refuses with the holder's name. ``specdeploy unlock --force`` breaks one
explicitly (audited). The local flock in :mod:`infra.ops.release.state` stays underneath.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from typing import Any, Protocol

from infra.ops.release.model import ReleaseError

DEFAULT_LEASE_S = 120.0  # a rollout renews every third of it; a crashed one frees the lock after it
LEASE_NAME = "specdeploy-release"
HOLDER_ANNOTATION = "specdeploy.dev/release-holder"  # the full Holder record, as JSON, on the Lease
ENV_HOLDER = "SPECDEPLOY_LOCK_HOLDER"  # who a pipeline is, e.g. "github-actions run 1234"

Audit = Callable[..., Any]  # StepLog.write: (event, **fields)


class Conflict(Exception):
    """The object changed (or appeared, or went) since it was read: someone else wrote it."""


@dataclass(frozen=True)
class Holder:
    """Who holds a stack's release lock, and until when (epoch seconds)."""

    holder: str  # user@host, or $SPECDEPLOY_LOCK_HOLDER
    pid: int
    command: str
    started_at: float
    renewed_at: float
    lease_s: float
    token: str  # this acquisition; tells a lock taken over from the one we took

    @property
    def expires_at(self) -> float:
        return self.renewed_at + self.lease_s

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.expires_at

    def renewed(self, now: float | None = None) -> Holder:
        return replace(self, renewed_at=time.time() if now is None else now)

    def describe(self) -> str:
        return (f"{self.holder} (pid {self.pid}, `{self.command}`) since {_utc(self.started_at)}, "
                f"lease until {_utc(self.expires_at)}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> Holder:
        try:
            data = json.loads(text)
            return cls(holder=str(data["holder"]), pid=int(data["pid"]), command=str(data["command"]),
                       started_at=float(data["started_at"]), renewed_at=float(data["renewed_at"]),
                       lease_s=float(data["lease_s"]), token=str(data["token"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ReleaseError(f"release lock {where} is not a specdeploy lock record ({exc}); "
                               "inspect it, then `specdeploy unlock --force` to remove it") from None


def me(command: str, lease_s: float = DEFAULT_LEASE_S) -> Holder:
    """This process as a lock holder."""
    if lease_s <= 0:
        raise ReleaseError(f"lock lease {lease_s:g}s must be positive")
    identity = os.environ.get(ENV_HOLDER) or f"{getpass.getuser()}@{socket.gethostname()}"
    now = time.time()
    return Holder(identity, os.getpid(), command, now, now, lease_s, uuid.uuid4().hex)


def command_line(argv: list[str] | None = None) -> str:
    return " ".join(["specdeploy", *(sys.argv[1:] if argv is None else argv)])[:200]


def _utc(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


class LockBackend(Protocol):
    """Compare-and-swap on one record. ``version`` is opaque (an ETag, a resourceVersion)."""

    where: str  # shown to the operator: s3://bucket/key, lease ns/name

    def read(self) -> tuple[Holder, str] | None: ...

    def create(self, holder: Holder) -> str: ...  # Conflict when it exists

    def replace(self, holder: Holder, version: str) -> str: ...  # Conflict when version is stale

    def delete(self, version: str) -> None: ...  # Conflict when version is stale or it is gone


class LockHeld(ReleaseError):
    def __init__(self, holder: Holder, where: str) -> None:
        super().__init__(f"the release lock of this stack is held by {holder.describe()} ({where}); wait for it "
                         "to finish, or if that process is gone, `specdeploy unlock --stack STACK --force`")
        self.holder = holder


class SharedLock:
    """Acquire, renew in the background while held, release; every change is audited."""

    def __init__(self, backend: LockBackend, holder: Holder, audit: Audit, attempts: int = 5) -> None:
        self.backend = backend
        self.holder = holder
        self.audit = audit
        self.attempts = attempts
        self.version: str | None = None
        self.lost: str | None = None  # why we no longer hold it, once that happened
        self._mutex = threading.Lock()

    @property
    def where(self) -> str:
        return self.backend.where

    def acquire(self) -> None:
        for _ in range(self.attempts):
            try:
                self.version = self.backend.create(self.holder)
                self.audit("lock_acquired", lock=self.where, **_fields(self.holder))
                return
            except Conflict:
                pass
            current = self.backend.read()
            if current is None:  # released between our create and our read: try again
                continue
            previous, version = current
            if not previous.expired():
                self.audit("lock_refused", lock=self.where, held_by=previous.describe(), **_fields(self.holder))
                raise LockHeld(previous, self.where)
            try:
                self.version = self.backend.replace(self.holder, version)
            except Conflict:
                continue  # another process took it over first; look again
            self.audit("lock_taken_over", lock=self.where, expired_holder=previous.describe(), **_fields(self.holder))
            return
        raise ReleaseError(f"could not take the release lock {self.where} in {self.attempts} attempts: "
                           "it keeps changing; try again")

    def renew(self) -> bool:
        """Push the expiry forward; False (and audited) when someone broke or took over the lock."""
        with self._mutex:
            if self.version is None or self.lost:
                return False
            renewed = self.holder.renewed()
            try:
                self.version = self.backend.replace(renewed, self.version)
            except Conflict:
                self.lost = "the lock was broken or taken over by someone else while this release ran"
                self.audit("lock_lost", lock=self.where, **_fields(self.holder))
                return False
            self.holder = renewed
            return True

    def release(self) -> None:
        with self._mutex:
            if self.version is None:
                return
            try:
                if not self.lost:
                    self.backend.delete(self.version)
                    self.audit("lock_released", lock=self.where, **_fields(self.holder))
            except Conflict:
                self.lost = "the lock was broken or taken over by someone else while this release ran"
                self.audit("lock_lost", lock=self.where, **_fields(self.holder))
            self.version = None

    def check(self) -> None:
        """Raise if the lock is no longer ours: a rollout must not shift traffic without it."""
        if self.lost:
            raise ReleaseError(f"release lock {self.where} lost: {self.lost}; traffic stays where it is "
                               "(`specdeploy rollback` or `rollout --resume` once you know who else is releasing)")

    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold the lock for the block, renewing it every third of the lease from a daemon thread."""
        self.acquire()
        stop = threading.Event()

        def keep() -> None:
            while not stop.wait(self.holder.lease_s / 3) and self.renew():
                pass

        renewer = threading.Thread(target=keep, name="release-lock-renewal", daemon=True)
        renewer.start()
        try:
            yield
        finally:
            stop.set()
            renewer.join(timeout=30)
            self.release()


def break_lock(backend: LockBackend, by: Holder, audit: Audit, reason: str) -> Holder | None:
    """Remove whatever lock is there (``unlock --force``); returns who held it, None when free."""
    current = backend.read()
    if current is None:
        return None
    previous, version = current
    backend.delete(version)  # Conflict: it changed under us; the caller says so, nothing is removed
    audit("lock_broken", lock=backend.where, previous_holder=previous.describe(),
          previous_expired=previous.expired(), reason=reason, **_fields(by))
    return previous


def _fields(holder: Holder) -> dict[str, Any]:
    return {"holder": holder.holder, "pid": holder.pid, "command": holder.command,
            "expires_at": round(holder.expires_at, 3)}


# --- AWS: one S3 object, conditional writes -------------------------------------------------------

LOCK_PREFIX = "release-lock"


class S3Lock:
    def __init__(self, s3: Any, bucket: str, stack: str) -> None:
        self.s3 = s3
        self.bucket = bucket
        self.key = f"{LOCK_PREFIX}/{stack}.json"
        self.where = f"s3://{bucket}/{self.key}"

    def read(self) -> tuple[Holder, str] | None:
        try:
            got = self.s3.get_object(Bucket=self.bucket, Key=self.key)
        except Exception as exc:
            if _s3_code(exc) in ("NoSuchKey", "404"):
                return None
            raise
        return Holder.from_json(got["Body"].read(), self.where), str(got["ETag"])

    def create(self, holder: Holder) -> str:
        return self._put(holder, IfNoneMatch="*")

    def replace(self, holder: Holder, version: str) -> str:
        return self._put(holder, IfMatch=version)

    def delete(self, version: str) -> None:
        try:
            self.s3.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=version)
        except Exception as exc:
            if _s3_code(exc) in _S3_CONFLICTS or _s3_code(exc) in ("NoSuchKey", "404"):
                raise Conflict(self.where) from None
            raise

    def _put(self, holder: Holder, **condition: str) -> str:
        try:
            put = self.s3.put_object(Bucket=self.bucket, Key=self.key, Body=holder.to_json().encode(),
                                     ContentType="application/json", **condition)
        except Exception as exc:
            # If-Match on a key that is gone answers 404: it was broken or released meanwhile
            if _s3_code(exc) in _S3_CONFLICTS or _s3_code(exc) in ("NoSuchKey", "404"):
                raise Conflict(self.where) from None
            if _s3_code(exc) == "NoSuchBucket":
                raise ReleaseError(f"the release lock's bucket {self.bucket} does not exist: pass --lock-bucket "
                                   "(or set SPECDEPLOY_RELEASE_BUCKET) to the stack's model bucket") from None
            if _s3_code(exc) == "AccessDenied":
                raise ReleaseError(f"no permission to write the release lock {self.where}: the release needs "
                                   f"s3:GetObject, s3:PutObject and s3:DeleteObject on {LOCK_PREFIX}/* and "
                                   "release-audit/* of that bucket (runbooks/rollout.md)") from None
            raise
        return str(put["ETag"])


# 412: the condition failed; 409: a concurrent conditional write to the same key won (S3 says retry).
_S3_CONFLICTS = ("PreconditionFailed", "ConditionalRequestConflict", "412", "409")


def _s3_code(exc: Exception) -> str:
    response = getattr(exc, "response", None)
    if not isinstance(response, Mapping):
        return ""
    return str(response.get("Error", {}).get("Code", ""))


# --- Kubernetes: a coordination.k8s.io/v1 Lease ----------------------------------------------------

LEASES = "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"


class KubeLease:
    def __init__(self, api: Any, namespace: str) -> None:
        self.api = api
        self.collection = LEASES.format(namespace=namespace)
        self.path = f"{self.collection}/{LEASE_NAME}"
        self.namespace = namespace
        self.where = f"Lease {namespace}/{LEASE_NAME}"

    def read(self) -> tuple[Holder, str] | None:
        from infra.ops.release.kubernetes import KubeApiError

        try:
            lease = self.api.get(self.path)
        except KubeApiError as exc:
            if exc.status == 404:
                return None
            raise
        record = (lease.get("metadata", {}).get("annotations") or {}).get(HOLDER_ANNOTATION)
        version = str(lease["metadata"]["resourceVersion"])
        if record is None:  # a Lease someone else wrote by hand or with another tool
            spec = lease.get("spec") or {}
            renewed = _parse_micro(spec.get("renewTime") or spec.get("acquireTime"))
            return Holder(str(spec.get("holderIdentity") or "unknown"), 0, "unknown", renewed, renewed,
                          float(spec.get("leaseDurationSeconds") or 0), ""), version
        return Holder.from_json(record, self.where), version

    def create(self, holder: Holder) -> str:
        return self._send("POST", self.collection, self._lease(holder, None))

    def replace(self, holder: Holder, version: str) -> str:
        return self._send("PUT", self.path, self._lease(holder, version))

    def delete(self, version: str) -> None:
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"resourceVersion": version}}
        self._send("DELETE", self.path, body)

    def _send(self, method: str, path: str, body: dict[str, Any]) -> str:
        from infra.ops.release.kubernetes import KubeApiError

        try:
            answer = self.api.request(method, path, body)
        except KubeApiError as exc:
            if exc.status in (404, 409):  # gone, exists, or resourceVersion stale
                raise Conflict(self.where) from None
            raise
        return str(answer.get("metadata", {}).get("resourceVersion", ""))

    def _lease(self, holder: Holder, version: str | None) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": LEASE_NAME, "namespace": self.namespace,
                                    "labels": {"app.kubernetes.io/name": "specdeploy",
                                               "app.kubernetes.io/component": "release-lock"},
                                    "annotations": {HOLDER_ANNOTATION: holder.to_json()}}
        if version is not None:
            metadata["resourceVersion"] = version
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata, "spec": {
            "holderIdentity": f"{holder.holder} pid {holder.pid}",
            "leaseDurationSeconds": max(1, round(holder.lease_s)),
            "acquireTime": _micro(holder.started_at),
            "renewTime": _micro(holder.renewed_at),
        }}


def _micro(epoch: float) -> str:
    """A Kubernetes MicroTime."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_micro(text: str | None) -> float:
    if not text:
        return 0.0
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
