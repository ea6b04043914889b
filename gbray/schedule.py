"""The learning rate over a night budgeted in time (SPEC §5: a longer night is never a worse night).

`wsd`, the default: a short linear warm-up, then the peak rate held (stable), then a cool-down to
the floor over the night's last fifth. The cool-down begins at whichever comes first:
- time: a fifth of the night's budget is left (`cooldown` of it): the shares of one night keep
  one clock, so they all cool down together, whatever their speed;
- data: the steps left before the slice's epochs are done are a fifth of them;
- a plateau (validation without gain, `patience` checks): the cool-down starts from the rate
  where it stands and lasts a quarter of the time trained so far (a fifth of the night that
  would have ended here), and then the night ends: it never ends at the peak rate.
Once begun it falls as 1 - sqrt of its progress (Hägele et al., arXiv 2405.18392: better than
linear; a constant rate with a cool-down of a fifth matched cosine, started at any point),
progress being the larger of the time and the steps gone towards the nearest of those ends.

`cosine` is the schedule nights had before: warm-up and cosine to the floor over the steps the
data or the time allow, re-planned once the speed is known; a plateau ends that night at the rate
it has. `schedule-free` is Schedule-Free AdamW (Defazio et al., arXiv 2405.15682; the trainer
takes its optimizer from the `schedulefree` package): warm-up, then the peak rate, the adapter
being the optimizer's running average; a plateau ends the night. Both are kept to be measured
against (benchmarks/hours_curve.py).

Written here rather than taken from transformers: its schedules are fixed functions of the step,
and this one's cool-down starts from where the rate stands, at a time the clock decides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KINDS = ("wsd", "cosine", "schedule-free")


@dataclass
class Schedule:
    kind: str
    peak: float
    floor: float
    warmup: int  # steps
    total: int  # steps the data and the time allow (re-planned once the speed is known)
    data_total: int  # steps the slice's epochs take
    cooldown: float  # the night's share the cool-down takes (wsd)
    warmup_share: float = 0.05
    replanned_from: int | None = None
    # The cool-down once begun: its first step, the rate it starts from, when it began and (a
    # plateau's) by when it ends, in seconds into the night, and what began it.
    cool_step: int | None = None
    cool_from: float | None = None
    cool_at: float | None = None
    cool_until: float | None = None
    cool_why: str | None = None

    @classmethod
    def new(cls, kind: str, peak: float, floor_ratio: float, warmup_share: float,
            data_total: int, cooldown: float) -> Schedule:  # fmt: skip
        if kind not in KINDS:
            raise ValueError(f"schedule must be one of {', '.join(KINDS)}")
        return cls(
            kind=kind,
            peak=peak,
            floor=peak * floor_ratio,
            warmup=math.ceil(warmup_share * data_total),
            total=data_total,
            data_total=data_total,
            cooldown=cooldown,
            warmup_share=warmup_share,
        )

    # -- the rate -------------------------------------------------------------------------------

    def rate(self, step: int, elapsed: float, end: float) -> float:
        """The rate of the optimizer step taken after `step` steps, `elapsed` seconds into the
        night whose training ends `end` seconds in."""
        if step < self.warmup:
            return self.peak * step / max(1, self.warmup)
        if self.kind == "cosine":
            if step >= self.total:  # faster than planned: the floor, not a cosine climbing back
                return self.floor
            progress = (step - self.warmup) / max(1, self.total - self.warmup)
            return self.floor + (self.peak - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))
        if self.cool_step is None:  # wsd's stable phase; schedule-free always
            return self.peak
        progress = self.cooled(step, elapsed, end)
        return self.floor + (self.cool_from - self.floor) * (1 - math.sqrt(progress))

    def cooled(self, step: int, elapsed: float, end: float) -> float:
        """How far the cool-down has gone, 0 to 1: towards the nearest of the end of training
        time, the end of the data and (after a plateau) its own end."""
        if self.cool_step is None:
            return 0.0
        ends = [(elapsed - self.cool_at) / max(1e-9, end - self.cool_at)]
        ends.append((step - self.cool_step) / max(1, self.data_total - self.cool_step))
        if self.cool_until is not None:
            ends.append((elapsed - self.cool_at) / max(1e-9, self.cool_until - self.cool_at))
        return min(1.0, max(0.0, *ends))

    def phase(self, step: int) -> str:
        if step < self.warmup:
            return "warm-up"
        if self.kind == "cosine":
            return "cosine"
        return "stable" if self.cool_step is None else "cool-down"

    # -- what moves it --------------------------------------------------------------------------

    def replan(self, steps_done: int, seconds_per_step: float, seconds_left: float) -> bool:
        """Fit the plan to the steps the remaining time allows, never past what the data plans.
        The warm-up follows the plan while it is still ahead. Returns whether it changed."""
        fit = steps_done + max(0, int(seconds_left / max(seconds_per_step, 1e-9)))
        total = max(steps_done + 1, min(self.data_total, fit))
        if total == self.total:
            return False
        self.replanned_from = self.replanned_from or self.data_total
        self.total = total
        warmup = math.ceil(self.warmup_share * total)
        if self.kind == "cosine" or steps_done < self.warmup:
            self.warmup = warmup
        return True

    def cool_down_due(self, step: int, elapsed: float, night: float) -> str | None:
        """What begins the cool-down now (`time` or `data`), if it is due and not begun. `night`
        is the budget in seconds: by time, the cool-down begins when `cooldown` of it is left,
        so every share of one night (one clock) begins together, whatever its speed."""
        if self.kind != "wsd" or self.cool_step is not None or step < self.warmup:
            return None
        if night - elapsed <= self.cooldown * night:
            return "time"
        if self.data_total - step <= math.ceil(self.cooldown * self.data_total):
            return "data"
        return None

    def begin_cool_down(self, step: int, elapsed: float, end: float, why: str) -> None:
        """Cool down from the rate where it stands; a plateau's lasts `cooldown / (1 - cooldown)`
        of the time trained so far (the last fifth of a night that ends there)."""
        self.cool_from = self.rate(step, elapsed, end)
        self.cool_step, self.cool_at, self.cool_why = step, elapsed, why
        if why == "plateau":
            self.cool_until = min(end, elapsed * (1 + self.cooldown / (1 - self.cooldown)))

    def record(self) -> dict:
        """What round.json says of it."""
        out = {
            "kind": self.kind,
            "peak": self.peak,
            "floor": self.floor,
            "warmup_steps": self.warmup,
            "planned_steps": self.total,
        }
        if self.kind == "wsd":
            out.update(
                cooldown_share=self.cooldown,
                cooldown_began_step=self.cool_step,
                cooldown_began_minute=None if self.cool_at is None else round(self.cool_at / 60, 2),
                cooldown_why=self.cool_why,
            )
        return out
