"""What a validation measures, and which of a night's adapters it keeps (SPEC §5).

A validation runs the held-out turns forward once and gives two numbers: the teacher-forced loss
on the answers, and the agreement, as the exam counts it: the share of turns whose recorded tool
greedy decoding would name (`gbray.model.tool_named`: every token up to the end of the tool's
name is the argmax). The loss alone kept an adapter that names one tool for everything.

The kept adapter has the best agreement, the loss breaking ties, where a tie is what the noise of
the validation turns allows. Two checks of one night sit the same turns, so they are compared
paired: of the turns only one of them names right, `only_new` and `only_kept`, the difference is
noise unless it passes `NOISE_SD` standard deviations of its null, sqrt(only_new + only_kept)
(the normal form of McNemar's test). So a new check replaces the kept adapter when it names more
turns right beyond that, or as many within it and has a lower loss; and never when it names fewer
than the best check so far beyond that (ties chained through lower losses could otherwise walk
the kept adapter down, one wobble at a time). A check that is not kept counts towards the
plateau (`patience`), so a chance wobble neither picks the adapter nor stops the night.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

# Standard deviations of the paired difference that a difference must pass to count: two is a
# wobble's chance of about one in twenty; one would be one in three.
NOISE_SD = 2.0
# What a night's kept adapter is chosen by (`--keep-by`).
KEEP_BY = ("agreement", "loss")


@dataclass
class Check:
    """One validation: where in the night it was and what it measured."""

    step: int
    turns: int  # turn-passes so far
    loss: float | None  # None where it was not finite
    agreement: float | None  # percent of the validation turns whose tool greedy decoding names
    marks: str  # per validation turn, "1" where it names the recorded tool
    lr: float
    phase: str
    minute: float
    train_loss: float | None = None
    kept: bool = False

    def record(self) -> dict:
        """As round.json keeps it (without the marks)."""
        out = asdict(self)
        out.pop("marks")
        return out

    def wire(self) -> dict:
        """As the hub's `check` call carries it (SPEC §8); `valAgreement` and `phase` are
        fields an old device omits."""
        return {
            "step": self.step,
            "turns": self.turns,
            "valLoss": self.loss,
            "trainLoss": self.train_loss,
            "best": self.kept,  # on the wire a boolean: whether this point is the best so far
            "lr": self.lr,
            "valAgreement": self.agreement,
            "phase": self.phase,
        }


def paired(new: Check, old: Check) -> tuple[int, float]:
    """(turns only `new` names right minus turns only `old` does, the noise of that difference)."""
    only_new = sum(a == "1" and b == "0" for a, b in zip(new.marks, old.marks, strict=True))
    only_old = sum(a == "0" and b == "1" for a, b in zip(new.marks, old.marks, strict=True))
    return only_new - only_old, NOISE_SD * math.sqrt(only_new + only_old)


def keeps(new: Check, kept: Check | None, top: Check | None, min_gain: float, by: str) -> bool:
    """Whether `new` replaces `kept` as the night's adapter. `top` is the check that named the
    most turns right so far. `by` "loss" is the rule nights had before: a lower loss alone."""
    if new.loss is None:
        return False
    if kept is None:
        return True
    if by == "loss":
        return new.loss < kept.loss - min_gain
    if top is not None:
        behind, noise = paired(top, new)
        if behind > noise:
            return False
    ahead, noise = paired(new, kept)
    if ahead != 0 and abs(ahead) > noise:
        return ahead > 0
    return new.loss < kept.loss - min_gain


def most_right(checks: list[Check]) -> Check | None:
    """The check that named the most turns right (the later of equals)."""
    scored = [c for c in checks if c.agreement is not None]
    return max(reversed(scored), key=lambda c: c.agreement) if scored else None
