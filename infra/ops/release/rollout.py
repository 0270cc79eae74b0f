"""Rollout and rollback, the same on every platform.

rollout: check the new slot is deployed and ready → launch-validate it alone →
for each step: shift, then watch the shift guard for the window → at 100 % make the stack
file say so. Any breach moves all traffic back in one call and leaves the stack file
on the old slot. The state is saved after every step, so a rollout killed at any
point can be resumed (``--resume``) or rolled back.

rollback: all traffic to the previous slot in one call, nothing else; writing that into the
stack file is a separate, reviewable step (``record``, or ``rollback(..., record=True)``).

After every weight change the alarm actions follow the traffic (``Release.alarm_actions``):
the slots with traffic page, a slot at 0 % does not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from infra.config import ReleaseSpec, StackFile, other_slot
from infra.ops.release.guard import ShiftGuard
from infra.ops.release.model import (
    ReleaseError,
    Slot,
    Weights,
    after_shift,
    as_slot,
    rollback_target,
    weights_to,
)
from infra.ops.release.stackfile import write_release
from infra.ops.release.state import RolloutState, StateStore, StepLog
from infra.ops.release.traffic import AlarmActions, TrafficRouter
from infra.ops.release.validation import Validator

Say = Callable[[str], None]  # progress lines for the operator


@dataclass
class Release:
    """One stack's release machinery: where traffic goes, what is watched, where it is recorded."""

    stack: StackFile
    router: TrafficRouter
    store: StateStore
    log: StepLog
    say: Say = field(default=lambda line: None)
    alarm_actions: AlarmActions | None = None  # paging follows traffic after every shift (AWS alarms)


@dataclass(frozen=True)
class Outcome:
    ok: bool  # the requested change happened (False: rolled back or refused)
    active: Slot  # slot carrying the traffic at the end
    weights: dict[str, int]
    reason: str | None = None  # why it stopped or rolled back
    stack_file_changed: bool = False
    rolled_back: bool = False  # traffic had moved and was moved back
    recorded: ReleaseSpec | None = None  # what the stack file says once recorded (rollback: unless --record)


def rollout(
    release: Release,
    to: str,
    steps: Sequence[int],
    observe_s: float,
    guard: ShiftGuard,
    validator: Validator | None,
    endpoints: Sequence[str],
    report_dir: Path,
    resume: bool = False,
) -> Outcome:
    """Validate ``to`` alone, shift ``steps`` percent to it under ``guard``; roll back on a breach."""
    with release.store.exclusive():
        return _rollout(release, to, steps, observe_s, guard, validator, endpoints, report_dir, resume)


def rollback(release: Release, to: str | None = None, force: bool = False, record: bool = False) -> Outcome:
    """All traffic to the previous slot in one router call (and paging with it); the stack file only
    with ``record`` — otherwise :func:`record` writes it later, as its own reviewable change.

    Refuses (unless ``force``) when that slot has nothing ready: it would route every request to nothing.
    """
    with release.store.exclusive():
        return _rollback(release, to, force, record)


def routed_release(spec: ReleaseSpec, weights: Weights) -> ReleaseSpec:
    """The stack-file release describing ``weights`` as routed: the slot with all traffic is active; a split
    keeps the recorded active slot (or the other one, should that have none) with the rest as canary."""
    for slot, percent in weights.items():
        if percent >= 100:
            return after_shift(spec, slot, 100)
    active = spec.active if weights.get(spec.active, 0) > 0 else other_slot(spec.active)
    return spec.model_copy(update={"active": active, "canary_weight": 100 - weights.get(active, 0)})


def record(release: Release) -> tuple[Outcome, str]:
    """Make the stack file say what the router routes now; returns the outcome and the unified diff."""
    import difflib

    path = release.stack.path
    before = path.read_text(encoding="utf-8")
    weights = release.router.weights()
    wanted = routed_release(release.stack.config.slots, weights)
    changed = write_release(path, wanted)
    after = path.read_text(encoding="utf-8")
    diff = "".join(difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                        fromfile=f"a/{path.name}", tofile=f"b/{path.name}"))
    release.log.write("record", weights=weights, active=wanted.active, canary_weight=wanted.canary_weight,
                      stack_file=str(path), changed=changed)
    return Outcome(True, wanted.active, weights, None, changed, recorded=wanted), diff


def _route(release: Release, weights: Weights) -> None:
    """One router call, then paging follows the new split."""
    release.router.set_weights(weights)
    if release.alarm_actions is not None:
        paging = release.alarm_actions.follow(weights)
        release.log.write("alarm_actions", enabled=paging)


def _rollout(release: Release, to: str, steps: Sequence[int], observe_s: float, guard: ShiftGuard,
             validator: Validator | None, endpoints: Sequence[str], report_dir: Path, resume: bool) -> Outcome:
    target = as_slot(to)
    spec = release.stack.config.slots
    if spec.slot(target) is None:
        raise ReleaseError(f"release.{target} is not defined in {release.stack.path}: put the new image and "
                           "model version in the idle slot and run `pulumi up` first")
    state = _start_or_resume(release, target, list(steps), observe_s, resume)
    log, say = release.log, release.say

    status = release.router.slot_status(target)
    log.write("slot_status", slot=target, ready=status.ready, detail=status.detail)
    say(f"{target}: {status.detail}")
    if not status.ready:
        return _refuse(release, state, f"{target} is not ready: {status.detail}")
    endpoints = list(endpoints) or status.endpoints
    for endpoint in endpoints:
        problem = _ready_endpoint(endpoint)
        log.write("slot_ready", slot=target, endpoint=endpoint, ok=problem is None, reason=problem)
        if problem:
            return _refuse(release, state, f"{target} at {endpoint}: {problem}")

    if not state.validated:
        if validator is None:
            log.write("validation_skipped", slot=target)
            say(f"launch validation skipped for {target} (--skip-validation)")
        else:
            if not endpoints:
                return _refuse(release, state, f"no endpoint reaches {target} alone; pass --slot-endpoint URL")
            say(f"launch validation (quick profile) against {target} at {endpoints[0]} ...")
            outcome = validator(release.stack, endpoints[0], report_dir)
            log.write("validation", slot=target, endpoint=endpoints[0], passed=outcome.passed,
                      summary=outcome.summary, report=outcome.report)
            report = f" (report: {outcome.report})" if outcome.report else ""
            if not outcome.passed:
                return _refuse(release, state, f"launch validation failed on {target}: {outcome.summary}{report}")
            say(f"launch validation passed: {outcome.summary}{report}")
        state.validated = True
        state.phase = "shifting"
        release.store.save(state)

    problem = guard.preflight(target) if state.current_weight == 0 else None
    if problem:
        return _refuse(release, state, problem)

    for weight in steps:
        if weight <= state.completed_weight:
            continue
        weights = weights_to(target, weight)
        release.store.check_lock()  # a broken or taken-over lock stops the rollout before it moves traffic
        _route(release, weights)
        state.current_weight = weight
        release.store.save(state)
        log.write("shift", slot=target, weight=weight, weights=weights, router=release.router.description)
        say(f"shifted {weight}% to {target}; observing for {observe_s:g}s")
        breach = guard.observe(target, weight, observe_s)
        if breach:
            return _roll_back_on_breach(release, state, breach)
        state.completed_weight = weight
        release.store.save(state)
        log.write("step_ok", slot=target, weight=weight)

    final = steps[-1]
    changed = write_release(release.stack.path, after_shift(spec, target, final))
    state.phase = "done"
    release.store.save(state)
    weights = weights_to(target, final)
    log.write("done", slot=target, weights=weights, stack_file=str(release.stack.path), stack_file_changed=changed)
    return Outcome(True, target if final >= 100 else other_slot(target), weights, None, changed)


def _rollback(release: Release, to: str | None, force: bool, record: bool) -> Outcome:
    spec = release.stack.config.slots
    state = release.store.load()
    interrupted = state if state is not None and state.unfinished else None
    target = as_slot(to) if to else rollback_target(spec, interrupted.from_slot if interrupted else None)
    if spec.slot(target) is None:
        raise ReleaseError(f"cannot roll back to {target}: release.{target} is not defined in {release.stack.path}")
    status = release.router.slot_status(target)
    release.log.write("slot_status", slot=target, ready=status.ready, detail=status.detail)
    if not status.ready and not force:
        raise ReleaseError(f"{target} has nothing ready to take the traffic ({status.detail}); "
                           "rolling back would send every request to nothing. --force does it anyway")
    weights = weights_to(target, 100)
    _route(release, weights)
    release.log.write("rollback", slot=target, weights=weights, router=release.router.description,
                      interrupted_rollout=interrupted is not None)
    recorded = after_shift(spec, target, 100)
    changed = write_release(release.stack.path, recorded) if record else False
    if interrupted is not None:
        interrupted.phase = "rolled_back"
        interrupted.reason = "rolled back by operator"
        interrupted.current_weight = 0
        release.store.save(interrupted)
    release.log.write("stack_file", path=str(release.stack.path), active=target, changed=changed, recorded=record)
    return Outcome(True, target, weights, None, changed, recorded=recorded if record else None)


def _start_or_resume(release: Release, target: Slot, steps: list[int], observe_s: float,
                     resume: bool) -> RolloutState:
    spec = release.stack.config.slots
    existing = release.store.load()
    name = release.stack.name
    if existing is not None and existing.unfinished:
        if not resume:
            raise ReleaseError(
                f"an interrupted rollout of {name} to {existing.to_slot} is at {existing.current_weight}% "
                f"(state {release.store.path}): continue it with --resume, or `specdeploy rollback --stack {name}`"
            )
        if existing.to_slot != target:
            raise ReleaseError(f"the interrupted rollout goes to {existing.to_slot}, not {target}")
        actual = release.router.weights().get(target, 0)
        release.log.write("resume", slot=target, completed_weight=existing.completed_weight,
                          current_weight=existing.current_weight, routed_weight=actual)
        release.say(f"resuming: {existing.completed_weight}% observed ok, {actual}% routed to {target} now")
        existing.steps = steps
        existing.observe_s = observe_s
        return existing
    if resume:
        raise ReleaseError(f"no interrupted rollout of {name} to resume (state {release.store.path})")
    if spec.active == target:
        raise ReleaseError(f"{target} is already the active slot of {name} (a canary on the other slot is "
                           f"removed with `specdeploy rollback --stack {name}`)")
    routed = release.router.weights()  # also proves the router is reachable before any state is kept
    state = RolloutState(stack=name, from_slot=other_slot(target), to_slot=target, steps=steps, observe_s=observe_s)
    release.store.save(state)
    release.log.write("start", slot=target, from_slot=state.from_slot, steps=steps, observe_s=observe_s,
                      weights=routed)
    return state


def _refuse(release: Release, state: RolloutState, reason: str) -> Outcome:
    """Stop before (more) traffic moved; if some had moved, this is a rollback."""
    if state.current_weight > 0:
        return _roll_back_on_breach(release, state, reason)
    state.phase = "failed"
    state.reason = reason
    release.store.save(state)
    release.log.write("refused", slot=state.to_slot, reason=reason)
    return Outcome(False, as_slot(state.from_slot), weights_to(state.from_slot, 100), reason)


def _roll_back_on_breach(release: Release, state: RolloutState, reason: str) -> Outcome:
    back = as_slot(state.from_slot)
    weights = weights_to(back, 100)
    _route(release, weights)
    release.log.write("rollback", slot=back, weights=weights, reason=reason, at_weight=state.current_weight,
                      automatic=True, router=release.router.description)
    changed = write_release(release.stack.path, after_shift(release.stack.config.slots, back, 100))
    state.phase = "rolled_back"
    state.reason = reason
    state.current_weight = 0
    release.store.save(state)
    release.log.write("stack_file", path=str(release.stack.path), active=back, changed=changed)
    return Outcome(False, back, weights, reason, changed, rolled_back=True)


def _ready_endpoint(endpoint: str) -> str | None:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{endpoint.rstrip('/')}/ready", timeout=10) as response:
            return None if response.status == 200 else f"/ready answered {response.status}"
    except urllib.error.HTTPError as exc:
        return f"/ready answered {exc.code}"
    except OSError as exc:
        return f"/ready unreachable: {exc}"
