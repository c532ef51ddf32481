"""The resident memory budget's policy (CLOUD_AGENT_RESIDENT_MEMORY_MB), pure.

Given what each resident costs (measured, or the runtime's estimate until it has been),
which of them are busy and when each was last used, it decides which idle residents to
retire — least recently used first — so that a new resident fits, or so that a turn on a
resident has room to grow. It never picks a busy resident.
It retires nothing when retiring every idle resident would still not make room: the
launch then waits for a turn to end rather than costing other members their LIVE turns
for nothing. A runtime's estimate is the largest it was ever measured at, never below a
floor from the measured baselines (protocols/baselines.md: idle and peak RSS per CLI), and a
resident never costs less than that floor. A resident in a turn costs its runtime's estimate:
a turn may grow its tree to the largest its runtime was ever measured at, and the budget must
hold before it does, not one reading after (stop 24: a resident that grew in its turn was
counted by its idle reading until the next periodic check, and the host's sampled peak was 7%
over the budget).

A launch does not retire a resident whose turn ended less than ``RECENT_S`` ago: a chat's next
message usually follows its receipt at once, and retiring its resident in that moment turns a
LIVE turn (seconds) into a RESTORED one (a launch, minutes under load) that itself needs room.
In the 48-chat load run without it, every launch took the resident that had just finished, all
96 follow-up turns were RESTORED and 138 residents were retired. Growth over the budget is
taken back from any idle resident at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

MiB = 1024 * 1024

# Peak RSS of each pinned CLI's tree in a sandbox, rounded up (protocols/baselines.md; Kilo and
# OpenCode with the bridge in front, measured here: 691 and 549 MiB).
FLOOR_ESTIMATES: Mapping[str, int] = {
    "claude": 300 * MiB, "codex": 160 * MiB, "pi": 180 * MiB, "opencode": 620 * MiB, "kilo": 720 * MiB,
}

MemberKey = tuple[str, str, str]

RECENT_S = 2.0  # seconds after its turn ended during which a launch leaves a resident alone


@dataclass(frozen=True)
class ResidentUse:
    key: MemberKey
    runtime: str
    measured: int | None  # bytes; None until its first measurement
    last_used: float
    busy: bool  # its member has work in flight or waiting: never retired for the budget
    in_turn: bool = False  # a turn runs on it now (and may grow it)


@dataclass(frozen=True)
class BudgetPlan:
    retire: tuple[MemberKey, ...]
    fits: bool
    used: int  # bytes in use after the retirements
    need: int  # bytes the new resident is expected to take


class BudgetPolicy:
    def __init__(self, budget_bytes: int, floors: Mapping[str, int] = FLOOR_ESTIMATES) -> None:
        self.budget = budget_bytes
        self._floors = dict(floors)
        self._estimates = dict(floors)
        self._default = max(floors.values(), default=0)

    def estimate(self, runtime: str) -> int:
        return self._estimates.get(runtime, self._default)

    def learn(self, runtime: str, measured: int) -> None:
        self._estimates[runtime] = max(self.estimate(runtime), measured)

    def cost(self, use: ResidentUse) -> int:
        """Its reading, or its runtime's estimate until read — and never below the runtime's
        floor: a reading taken while the CLI is still starting (OpenCode climbs to ~550 MiB
        over seconds) must not free room it is about to take. An idle resident is not counted
        at the learnt estimate (one resident's big turn must not make every idle resident of its
        runtime look as big); a resident in a turn is, because that is what its turn may take."""
        if use.measured is None or use.in_turn:
            return max(use.measured or 0, self.estimate(use.runtime))
        return max(use.measured, self._floors.get(use.runtime, self._default))

    def used(self, uses: Iterable[ResidentUse], reserved: int = 0) -> int:
        return sum(self.cost(u) for u in uses) + reserved

    def plan(self, uses: list[ResidentUse], incoming: str | None = None, reserved: int = 0, *,
             now: float | None = None) -> BudgetPlan:
        """Retirements that make ``incoming`` (a runtime about to launch, or None) fit.

        ``reserved``: bytes of launches already decided but not yet resident. A launch
        into an empty host always fits: one resident larger than the budget must still run.
        ``now`` (monotonic): a launch leaves residents used within ``RECENT_S`` of it alone.
        """
        need = self.estimate(incoming) if incoming is not None else 0
        used = self.used(uses, reserved)
        if used + need <= self.budget:
            return BudgetPlan((), True, used, need)
        if incoming is not None and not uses and reserved == 0:
            return BudgetPlan((), True, used, need)
        retire: list[MemberKey] = []
        left = used
        recent = now - RECENT_S if now is not None and incoming is not None else float("inf")
        for use in sorted((u for u in uses if not u.busy and u.last_used <= recent), key=lambda u: u.last_used):
            if left + need <= self.budget:
                break
            retire.append(use.key)
            left -= self.cost(use)
        if left + need <= self.budget:
            return BudgetPlan(tuple(retire), True, left, need)
        if incoming is None:
            return BudgetPlan(tuple(retire), False, left, need)  # growth: take back what can be taken
        return BudgetPlan((), False, used, need)
