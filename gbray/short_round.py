"""The short-round recipe for any pretrained student, from what is measured: its speed on this
machine (turn-passes an hour: its size as this machine feels it), its context, the round's hours
and, where known, how many turns the corpus holds.

SPEC §5's night recipe (lr 2e-4, 16 turns a step) is made for nights: on SmolLM2-135M a 6-minute
round under it took 5 optimizer steps and learnt nothing. A short round needs enough steps to
move and a rate hot enough to move in them; how many turns a step can take follows from how many
turn-passes the hours hold, which is the student's measured speed times the hours. `gbray student`
measures the speed when it builds a pretrained student (gbray.pretrained) and writes it to
student.json; each round turns it into its recipe for its own hours (`short_round`), and
recipe.json says why each value was taken. Flags given on the command line win.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

# Optimizer steps a short round aims at. SmolLM2-135M measured on 2 cores: 57 steps in 6 minutes
# (2 turns a step) learnt 0.7% -> 49.3%, 103 in 30 minutes (4 a step) 0.8% -> 66.7%.
STEPS = 100
# A round steps at about this share of the measured speed: SmolLM2-135M measured 5,086
# turn-passes an hour in the probe's 4-turn steps and its 6-minute round ran 2,316 an hour
# (fewer turns a step share less prefix; validation; start-up). gbray's tiny student ran 1.2x
# its probe: the lower share is taken, since too many turns a step leave a short round too few
# steps, while the slice is sized by the speed measured (a slice too big only goes unfinished;
# one too small ends the round early).
ROUND_SHARE = 0.45
MAX_EPOCHS = 10
# At this many steps a round is a night, and takes SPEC §5's rate.
NIGHT_STEPS = 1_000
SHORT_LR, NIGHT_LR = 1e-3, 2e-4
# Validation may take at most this share of the hours (each check is a forward over the
# validation turns: about a third of a turn-pass each).
VALIDATION_SHARE = 0.15
VAL_TURNS = 64  # held-out turns a round validates on (Recipe's default)


@dataclass(frozen=True)
class Measured:
    """What a round's recipe is chosen from, measured where the student was built."""

    parameters: int
    turns_per_hour: float  # turn-passes an hour, in whole optimizer steps of a few turns
    positions: int  # the longest context the student takes
    threads: int  # the threads the speed was measured on

    def as_record(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, record: dict) -> Measured:
        return cls(
            **{k: record[k] for k in ("parameters", "turns_per_hour", "positions", "threads")}
        )


@dataclass(frozen=True)
class Choice:
    """Recipe values and, for each, why it was taken."""

    values: dict
    why: dict


def short_round(measured: Measured, hours: float, corpus: int | None = None) -> Choice:
    """The recipe of a round of `hours` for a student of this measured speed; `corpus`, where
    known, is how many turns the slice can be drawn from."""
    speed = measured.turns_per_hour * ROUND_SHARE
    passes = hours * speed
    offered = hours * measured.turns_per_hour
    epochs = 2.0
    if corpus and offered > 2 * corpus:
        epochs = float(min(MAX_EPOCHS, math.ceil(offered / corpus)))
    per_step = min(16, max(1, round(passes / STEPS)))
    steps = passes / per_step
    night = steps >= NIGHT_STEPS
    check_hours = VAL_TURNS / (3 * speed)
    checks = min(8, max(1, int(VALIDATION_SHARE * hours / check_hours)))
    values = {
        "turns_per_hour": round(measured.turns_per_hour, 1),
        "accum": per_step,
        "lr": NIGHT_LR if night else SHORT_LR,
        "epochs": epochs,
        "lora_dropout": 0.0,
        "answer_budget": 96,
        "max_len": min(4096, measured.positions),
        "val_every_minutes": round(hours * 60 / (checks + 1), 2),
    }
    why = {
        "turns_per_hour": f"measured: {measured.turns_per_hour:.0f} turn-passes an hour on "
        f"{measured.threads} threads (the slice is sized by it; a round steps at about "
        f"{ROUND_SHARE:.0%} of it)",
        "accum": f"{passes:.0f} turn-passes in {hours:g} h: {per_step} turns a step gives "
        f"about {steps:.0f} steps (aim {STEPS}; at most 16 a step, SPEC's night)",
        "lr": (
            f"{steps:.0f} steps is a night: SPEC's rate"
            if night
            else f"{steps:.0f} steps (under {NIGHT_STEPS}): a short round's rate; SPEC's "
            "2e-4 over 5 steps learnt nothing"
        ),
        "epochs": (
            f"{offered:.0f} turn-passes offered by the hours, {corpus} turns in the corpus: "
            f"{epochs:g} passes over it, so the data does not end the round early"
            if epochs > 2
            else "a short slice seen twice"
        ),
        "lora_dropout": "off: it costs 1.2-1.5x the step time (benchmarks/train_profile.py), "
        "and a short round does not overfit",
        "answer_budget": "a tool call is about 20 tokens; a bare student that rambles costs the "
        "exam the whole budget on every turn",
        "max_len": f"SPEC's 4096, within the student's {measured.positions} positions",
        "val_every_minutes": f"{checks} check(s) before the end: each costs about "
        f"{check_hours * 60:.1f} min here, and checks may take {VALIDATION_SHARE:.0%} of the "
        "hours",
    }
    return Choice(values, why)
