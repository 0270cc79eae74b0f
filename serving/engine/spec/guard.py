"""The guard over the adaptive policy: speculation stays on only where it measures faster than not speculating.

The policy (policy.py) chooses k from a model: fitted step costs and acceptance estimates. A model leaves things
out. Under load the cost of a speculating sequence is spread over the forward, the draft, the bookkeeping and
everything the process does between steps (the API thread emitting several tokens a step, under one GIL), and
a choice that the model prices at +5 % can run at -10 %. The guard checks the choice against the clock.

It times engine *cycles*: from one proposal to the next, which holds the drafting for a step, the step that
verifies it, and whatever runs between steps. A cycle was left to the policy (a *drafting* cycle: the policy chose
each k, 0 included) or the guard ran it plain (a *plain* cycle). The two are told apart by who decided, not by
whether anything drafted: the cycles where the policy itself chose k = 0 everywhere are not a fair sample of plain
decoding. They cluster where a wave of requests starts or ends (first outputs, whose drafts are seldom accepted;
last tokens, too few to draft), which are the heavy moments between steps (new prompts tokenized and admitted,
finished requests detokenized and answered, under the same GIL); counted as plain, they would pull the plain figure
below what plain decoding runs at, and drafting at a tie would read as ahead. Cycles are kept apart by how many
requests run (half-octave buckets: 1, 2, 3, 4, 6, 8, 11, 16, 23, 32, 45, 64 ...), and per bucket the guard keeps
the tokens per second of drafting and of plain cycles (decayed sums of tokens and seconds over about the last fifty
of each kind: several requests' worth at low load, so that one prompt the draft guesses badly does not decide). A
cycle whose step also carried prefill tokens or preempted a request has no rate to compare; where the policy
decided it, what its proposal took (the draft's catch-up on new prompts above all) is added to the bucket's
drafting seconds all the same. Then:

- a bucket with too few plain cycles gets one now and then (every 4th cycle until there are MIN_SAMPLES, then
  one every REFRESH_NEAR cycles so that the figure follows the load): the policy is not consulted for that
  cycle and nothing drafts, so that it costs what a spec-off engine's step does;
- where drafting cycles measure below VETO_BELOW of plain ones, the bucket is vetoed: every k is 0. Every
  PROBE_EVERY cycles a probe of PROBE_CYCLES lets the policy draft again, on fresh evidence (the bucket's
  drafting figure starts anew), and the veto lifts only if the probe, judged at its end, measures at least
  LIFT_AT of plain. A probe costs what drafting loses over its cycles, plus the catch-up of every request's
  draft (it lags while the bucket runs plain), so where drafting cannot win the probes back off: each probe
  that leaves the veto on, and each veto that follows a lift within PROBE_EVERY_MAX cycles (a lift on a
  lucky probe), doubles the bucket's interval up to PROBE_EVERY_MAX; a veto after a lift that held that long
  starts again from PROBE_EVERY.

Plain cycles are refreshed rarely where drafting clearly wins (FAR_AHEAD): there each forced plain cycle costs
what speculation would have gained.

The bucket a cycle is decided in is that of the load *level*: the most requests running over the last
LOAD_WINDOW cycles, not the count of this cycle alone. Under a steady load the count dips for a few cycles
whenever requests finish before their successors arrive (64 running, then 48 for three cycles, then 64 again).
Bucketed by the instant count, such a load would move between two buckets with their own verdicts, and where
the lower one drafts and the higher one is vetoed, each dip would resume drafting for every request at once,
each paying the catch-up of all the steps its draft sat out. A dip keeps its level's verdict; its rate, that of
a lighter load, is left out of the level's figures, and a load that really falls changes bucket LOAD_WINDOW
cycles later.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

MIN_SAMPLES = 6  # cycles of each kind before the bucket's rates are compared
# drafting ÷ plain tokens/s that turns a bucket off, and that turns it back on: drafting has to stay ahead by a
# margin, since near a tie the rates' noise (several per cent a cycle under load) decides, and a bucket left on by
# noise pays for speculation where a bucket turned off by it forgoes at most the margin
VETO_BELOW, LIFT_AT = 1.03, 1.08
DECAY = 0.98  # per observed cycle of the kind: about the last fifty count
FAR_AHEAD = 1.25  # drafting this much faster: plain cycles refreshed every REFRESH_FAR cycles...
REFRESH_NEAR, REFRESH_FAR = 48, 400  # ...else every REFRESH_NEAR
PROBE_EVERY, PROBE_CYCLES = 128, 16  # while vetoed: a probe of this many drafting cycles every PROBE_EVERY
PROBE_EVERY_MAX = 1024  # the interval's ceiling as failed probes double it
LOAD_WINDOW = 16  # cycles over which the load level is the most requests running


def bucket(num_running: int) -> int:
    """Half-octave bucket of the number of running requests."""
    return int(round(2 * math.log2(max(num_running, 1))))


@dataclass
class Rate:
    tokens: float = 0.0
    seconds: float = 0.0
    samples: int = 0
    age: int = 0  # cycles of the bucket since the last sample

    def observe(self, tokens: int, seconds: float) -> None:
        self.tokens = DECAY * self.tokens + tokens
        self.seconds = DECAY * self.seconds + seconds
        self.samples += 1
        self.age = 0

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Bucket:
    drafting: Rate = field(default_factory=Rate)
    plain: Rate = field(default_factory=Rate)
    vetoed: bool = False
    cycles: int = 0  # cycles seen in this bucket
    probing: int = 0  # drafting cycles left in the current probe of a veto
    probe_every: int = PROBE_EVERY  # cycles between probes while vetoed (doubled by failed probes)
    lifted_at: int | None = None  # the bucket's cycle count at its last lift

    def ratio(self) -> float | None:
        """Drafting ÷ plain tokens/s, once both have MIN_SAMPLES."""
        if min(self.drafting.samples, self.plain.samples) < MIN_SAMPLES or self.plain.per_second <= 0:
            return None
        return self.drafting.per_second / self.plain.per_second


@dataclass
class SpeculationGuard:
    buckets: dict[int, Bucket] = field(default_factory=dict)
    cycles_total: int = 0  # cycles the guard decided (exported, with the three below, as specdeploy_spec_guard_*)
    vetoes_total: int = 0  # buckets turned off (a bucket that turns off, on and off again counts twice)
    forced_plain_total: int = 0  # cycles set to k = 0 to measure plain decoding
    vetoed_cycles_total: int = 0  # cycles set to k = 0 by a veto
    _recent: deque[int] = field(default_factory=lambda: deque(maxlen=LOAD_WINDOW))  # running, the last cycles

    def level(self) -> int:
        """The bucket of the load level: the most requests running over the last LOAD_WINDOW cycles."""
        return bucket(max(self._recent, default=1))

    def _bucket_of_cycle(self, num_running: int) -> int:
        """The bucket of the cycle allows_drafting last decided (its level's: nothing is appended between the
        decision and the cycle's observe or charge), or num_running's where no cycle was decided."""
        return self.level() if self._recent else bucket(num_running)

    def observe(self, num_running: int, allowed: bool, tokens: int, seconds: float) -> None:
        """The cycle last decided was clean (no prefill, no preemption), with num_running requests: tokens
        emitted in `seconds`; allowed: whether allows_drafting() left it to the policy (a drafting cycle, whatever
        k the policy chose). A cycle in a dip below its level is left out: its rate is a lighter load's."""
        key = self._bucket_of_cycle(num_running)
        if bucket(num_running) != key:
            return
        b = self.buckets.setdefault(key, Bucket())
        (b.drafting if allowed else b.plain).observe(tokens, seconds)
        ratio = b.ratio()
        if ratio is None:
            return
        if not b.vetoed and ratio < VETO_BELOW:
            b.vetoed = True
            self.vetoes_total += 1
            if b.lifted_at is not None and b.cycles - b.lifted_at < PROBE_EVERY_MAX:
                b.probe_every = min(2 * b.probe_every, PROBE_EVERY_MAX)  # the lift did not hold
            else:
                b.probe_every = PROBE_EVERY
            log.info("speculation off at ~%d running requests: drafting cycles %.0f tokens/s, plain %.0f; "
                     "probed every %d cycles", num_running, b.drafting.per_second, b.plain.per_second, b.probe_every)

    def charge(self, num_running: int, seconds: float) -> None:
        """What a drafting cycle's proposal took (the policy, the draft's catch-ups and forwards) where its step
        also prefilled, so that it has no rate to compare: charged to the bucket's drafting time. A wave of new
        requests runs mostly in such steps, and the draft's catch-up on each new prompt, which only drafting
        pays, would otherwise never be seen (at 64 sequences of 300-token prompts: ~19,000 draft tokens a wave)."""
        b = self.buckets.setdefault(self._bucket_of_cycle(num_running), Bucket())
        b.drafting.seconds += seconds

    def allows_drafting(self, num_running: int) -> bool:
        """Whether the next cycle with num_running requests may draft (the policy then chooses k), or must run
        plain: every k = 0, and the policy not even consulted, so that a plain cycle costs what spec-off does.
        Decided in the bucket of the load level (level()), num_running included."""
        self._recent.append(num_running)
        b = self.buckets.setdefault(self.level(), Bucket())
        self.cycles_total += 1
        b.cycles += 1
        b.plain.age += 1
        b.drafting.age += 1
        if b.vetoed:
            if b.probing == 0 and b.drafting.age >= b.probe_every:
                b.probing = PROBE_CYCLES
                b.drafting = Rate()  # the probe decides on its own evidence
            if b.probing > 0:
                b.probing -= 1
                if b.probing == 0:  # the probe's last cycle: its evidence decides, not its first few cycles
                    self._judge_probe(b, num_running)
                return True
            self.vetoed_cycles_total += 1
            return False
        if b.plain.samples < MIN_SAMPLES:
            due = b.cycles % 4 == 0
        else:
            ratio = b.ratio()
            due = b.plain.age >= (REFRESH_FAR if ratio is not None and ratio >= FAR_AHEAD else REFRESH_NEAR)
        if due:
            self.forced_plain_total += 1
        return not due

    def _judge_probe(self, b: Bucket, num_running: int) -> None:
        """Lift the veto where the probe's drafting cycles measured at least LIFT_AT of plain ones, else double
        the bucket's probe interval. Judged as the probe's last cycle starts, on every probe cycle before it,
        not as soon as MIN_SAMPLES of them read well: a probe's first cycles can read well on a load where
        drafting loses (the requests whose draft is up to date draft first), and a lift on them pays every
        request's catch-up only to be vetoed again."""
        ratio = b.ratio()
        if ratio is not None and b.drafting.samples >= MIN_SAMPLES and ratio >= LIFT_AT:
            b.vetoed = False
            b.lifted_at = b.cycles
            log.info("speculation back on at ~%d running requests: drafting cycles %.0f tokens/s, plain %.0f",
                     num_running, b.drafting.per_second, b.plain.per_second)
        else:
            b.probe_every = min(2 * b.probe_every, PROBE_EVERY_MAX)

    def describe(self) -> dict[str, object]:
        """Per bucket: drafting and plain tokens/s, their sample counts, whether it is vetoed and its probe
        interval."""
        return {str(k): {"drafting_tps": round(b.drafting.per_second, 1), "plain_tps": round(b.plain.per_second, 1),
                         "samples": [b.drafting.samples, b.plain.samples], "vetoed": b.vetoed,
                         "probe_every": b.probe_every}
                for k, b in sorted(self.buckets.items())}
