"""What a rollout has done so far, on disk: a resumable state file and a JSON-lines step log.

Both live under ``.specdeploy/release/`` (ignored by git): ``<stack>.state.json`` is
rewritten atomically after every step, so a rollout killed at any point can be
resumed or rolled back; ``<stack>.jsonl`` gets one line per event and is never
truncated, the audit trail of every release of that stack on this machine.

Across machines, :class:`StateStore` takes the stack's shared lock (an S3 object or a Kubernetes
Lease, :mod:`infra.ops.release.lock`) inside the local flock, and :class:`StepLog` copies the
events operators audit to the bucket or the cluster (:mod:`infra.ops.release.audit`).
"""

from __future__ import annotations

import fcntl
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from infra.ops.release.model import ReleaseError
from serving.files import atomic_write

if TYPE_CHECKING:
    from infra.ops.release.audit import AuditSink
    from infra.ops.release.lock import SharedLock

Phase = Literal["validating", "shifting", "done", "rolled_back", "failed"]
UNFINISHED: frozenset[str] = frozenset({"validating", "shifting"})


@dataclass
class RolloutState:
    stack: str
    from_slot: str  # the slot that had the traffic when the rollout started
    to_slot: str  # the slot being rolled out
    steps: list[int]  # percent of traffic on to_slot, in order
    observe_s: float  # observe window per step
    phase: Phase = "validating"
    validated: bool = False  # launch validation passed against to_slot alone
    current_weight: int = 0  # percent on to_slot as last set on the router
    completed_weight: int = 0  # percent on to_slot whose observe window passed
    started_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    reason: str | None = None  # why it failed or rolled back

    @property
    def unfinished(self) -> bool:
        return self.phase in UNFINISHED

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RolloutState:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


class StateStore:
    """The state file of one stack's rollout."""

    def __init__(self, directory: Path, stack: str, shared: SharedLock | None = None) -> None:
        self.path = directory / f"{stack}.state.json"
        self.lock_path = directory / f"{stack}.lock"
        self.shared = shared  # the stack's lock in S3 or a Lease; None: this machine only (local stacks)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """One rollout or rollback of a stack at a time: an advisory flock on this machine, then the
        shared lock every machine sees (held, and renewed, until the block ends)."""
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        with self.lock_path.open("a+") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ReleaseError(f"another rollout or rollback of this stack is running ({self.lock_path})") from None
            try:
                if self.shared is None:
                    yield
                else:
                    with self.shared.held():
                        yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def check_lock(self) -> None:
        """Raise before traffic moves if the shared lock was broken or taken over meanwhile."""
        if self.shared is not None:
            self.shared.check()

    def load(self) -> RolloutState | None:
        if not self.path.is_file():
            return None
        return RolloutState.from_json(json.loads(self.path.read_text(encoding="utf-8")))

    def save(self, state: RolloutState) -> None:
        state.updated_at = time.time()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, json.dumps(asdict(state), indent=2, sort_keys=True) + "\n")


class StepLog:
    """Append-only JSON lines: ``{"ts": ..., "stack": ..., "event": ..., ...}``, flushed per line.

    With ``remote``, the audited events (:data:`infra.ops.release.audit.AUDITED`) are also appended
    there, tagged with ``by`` (who ran the command). A remote that fails does not stop a release
    (a rollback must not fail for want of an audit write): the failure is logged locally instead.
    """

    def __init__(self, path: Path, stack: str, remote: AuditSink | None = None, by: str | None = None) -> None:
        self.path = path
        self.stack = stack
        self.remote = remote
        self.by = by

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"ts": round(time.time(), 6), "stack": self.stack, "event": event, **fields}
        self._append(record)
        if self.remote is not None:
            from infra.ops.release.audit import AUDITED

            if event in AUDITED:
                try:
                    self.remote.append({**record, "by": self.by} if self.by else record)
                except Exception as exc:  # any client error: recorded, never raised
                    self._append({"ts": round(time.time(), 6), "stack": self.stack, "event": "audit_unwritten",
                                  "audit": self.remote.where, "of": event, "error": str(exc)[:300]})
        return record

    def _append(self, record: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, sort_keys=False, default=str) + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()]
