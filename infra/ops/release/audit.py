"""The release audit trail next to the lock: who moved traffic, took or broke the lock, and when.

The local JSON-lines step log (:class:`~infra.ops.release.state.StepLog`) keeps every event of
this machine; the events in :data:`AUDITED` also go where every operator can read them:

* AWS: one object per event, ``s3://<model bucket>/release-audit/<stack>/<UTC time>-<pid>-<event>.json``
  (written with ``If-None-Match: *``, never overwritten; keys sort in time order).
* Kubernetes: ConfigMap ``specdeploy-release-audit`` in the stack's namespace, one data key per event
  (same name scheme), appended by replace-with-``resourceVersion`` and retried on 409; the oldest
  entries beyond :data:`MAX_CONFIGMAP_EVENTS` are dropped (a ConfigMap holds at most 1 MiB).
"""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime
from typing import Any, Protocol

from infra.ops.release.model import ReleaseError

AUDITED: frozenset[str] = frozenset({
    "lock_acquired", "lock_refused", "lock_taken_over", "lock_released", "lock_lost", "lock_broken",
    "start", "resume", "validation", "validation_skipped", "shift", "rollback", "refused", "done",
    "interrupted", "stack_file",
})
AUDIT_PREFIX = "release-audit"
CONFIGMAP_NAME = "specdeploy-release-audit"
MAX_CONFIGMAP_EVENTS = 1000


class AuditSink(Protocol):
    where: str

    def append(self, record: dict[str, Any]) -> None: ...

    def read(self) -> list[dict[str, Any]]: ...


def event_name(record: dict[str, Any]) -> str:
    """``20261204T051200.123456Z-4242-shift.json``: sorts by time; pid keeps two writers apart."""
    stamp = datetime.fromtimestamp(float(record["ts"]), UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    return f"{stamp}-{os.getpid()}-{record['event']}.json"


class S3Audit:
    def __init__(self, s3: Any, bucket: str, stack: str) -> None:
        self.s3 = s3
        self.bucket = bucket
        self.prefix = f"{AUDIT_PREFIX}/{stack}/"
        self.where = f"s3://{bucket}/{self.prefix}"

    def append(self, record: dict[str, Any]) -> None:
        body = json.dumps(record, default=str).encode()
        self.s3.put_object(Bucket=self.bucket, Key=self.prefix + event_name(record), Body=body,
                           ContentType="application/json", IfNoneMatch="*")

    def read(self) -> list[dict[str, Any]]:
        keys: list[str] = []
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix):
            keys += [item["Key"] for item in page.get("Contents", [])]
        return [json.loads(self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()) for key in sorted(keys)]


class ConfigMapAudit:
    def __init__(self, api: Any, namespace: str, attempts: int = 8) -> None:
        self.api = api
        self.namespace = namespace
        self.collection = f"/api/v1/namespaces/{namespace}/configmaps"
        self.path = f"{self.collection}/{CONFIGMAP_NAME}"
        self.where = f"ConfigMap {namespace}/{CONFIGMAP_NAME}"
        self.attempts = attempts

    def append(self, record: dict[str, Any]) -> None:
        from infra.ops.release.kubernetes import KubeApiError

        key, value = event_name(record), json.dumps(record, default=str)
        for attempt in range(self.attempts):
            try:
                current = self._get()
                if current is None:
                    self.api.request("POST", self.collection, self._configmap({key: value}, None))
                    return
                data = {**(current.get("data") or {}), key: value}
                kept = dict(sorted(data.items())[-MAX_CONFIGMAP_EVENTS:])
                self.api.request("PUT", self.path, self._configmap(kept, current["metadata"]["resourceVersion"]))
                return
            except KubeApiError as exc:
                if exc.status != 409:  # 409: created or changed by another writer since we read it
                    raise
                time.sleep(0.05 * (attempt + 1))
        raise ReleaseError(f"could not append to {self.where} in {self.attempts} attempts (409 each time)")

    def read(self) -> list[dict[str, Any]]:
        current = self._get()
        data = (current or {}).get("data") or {}
        return [json.loads(value) for _, value in sorted(data.items())]

    def _get(self) -> dict[str, Any] | None:
        from infra.ops.release.kubernetes import KubeApiError

        try:
            found: dict[str, Any] = self.api.get(self.path)
        except KubeApiError as exc:
            if exc.status == 404:
                return None
            raise
        return found

    def _configmap(self, data: dict[str, str], version: str | None) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": CONFIGMAP_NAME, "namespace": self.namespace,
                                    "labels": {"app.kubernetes.io/name": "specdeploy",
                                               "app.kubernetes.io/component": "release-audit"}}
        if version is not None:
            metadata["resourceVersion"] = version
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}
