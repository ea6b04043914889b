"""Shares (SPEC §9): several trainers train disjoint parts of one slice from the same start, on
different machines where the cluster has them, and their adapters are merged.

This module is what a shares night is, whatever runs it: a share and what became of it, the
parts cut in proportion to each share's measured speed (machines differ by 100x: every share
ends inside the hours with its epochs done), how often a share syncs, and a share's own round on
the hub. Where the shares run, and how a lost machine is noticed, is the cluster's
(gbray.ray_cluster, gbray.local_cluster). One share is the plain round.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gbray.results import TrainSummary
from gbray.settings import TrainerJob

PROBE_TURNS = 4


@dataclass
class Share:
    """One share of a night: where it ran, what it was given, what became of it."""

    index: int
    node: str | None = None
    hub_round: str | None = None
    probe_turns_per_hour: float | None = None
    turns: int = 0
    summary: TrainSummary | None = None
    lost: str | None = None  # why it was left out
    exam: object | None = None  # its own exam, when shares are examined
    out: str = ""
    adapter: str | None = None  # the adapter it gives the merge
    weight: float = 0.0  # its weight in the merge: the turns it trained
    joined_minute: float | None = None  # a machine that joined during the night
    left_minute: float | None = None  # a machine that went away

    def trained(self, summary: TrainSummary) -> None:
        self.summary, self.adapter, self.weight = summary, summary.best, summary.turns_trained


@dataclass
class Trained:
    """What training produced, from one share or several."""

    shares: list[Share]
    packed_note: str | None = None
    split: list[int] = field(default_factory=list)
    average_every_seconds: float = 0.0
    merged: dict | None = None  # the averager's global adapter: its folder, syncs and members

    @property
    def survivors(self) -> list[Share]:
        return [s for s in self.shares if s.adapter is not None and s.lost is None]

    @property
    def turns_trained(self) -> int:
        return sum(s.summary.turns_trained for s in self.survivors if s.summary)


def split_by_speed(turns: int, speeds: list[float]) -> list[int]:
    """Cut `turns` into parts proportional to `speeds` (largest remainders), none empty."""
    total = sum(speeds)
    if total <= 0:
        speeds, total = [1.0] * len(speeds), float(len(speeds))
    exact = [turns * v / total for v in speeds]
    parts = [max(1, int(x)) for x in exact]
    order = sorted(range(len(speeds)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    k = 0
    while sum(parts) < turns:
        parts[order[k % len(order)]] += 1
        k += 1
    while sum(parts) > turns:
        i = max(range(len(parts)), key=lambda j: parts[j])
        parts[i] -= 1
    return parts


@dataclass
class ShareNight:
    """Everything a shares night needs to launch its trainers."""

    job: TrainerJob  # the night's: each share's is `job.for_share(index)`
    new_hub: Callable  # () -> Hub: each share reports as a round of its own
    hub_recipe: dict
    student_id: str
    grace_seconds: float = 120.0
    average_every_seconds: float = 0.0  # 0: the shares meet only in the merge
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    pool_gradients: bool = False  # shares take in each other's step gradients (gbray.averaging)
    step_together: bool = False  # shares of equal speed step together (gbray.peers)
    joins: bool = False  # keep a part of the slice back for a machine that joins
    options: list[dict] = field(default_factory=list)  # per share: extra actor options (tests)


def sync_turns(night: ShareNight, speeds: list[float]) -> int:
    """Turns between a share's syncs: what the fastest share trains in the interval, at least
    one optimizer step's (so a share three times slower syncs three times less often)."""
    recipe = night.job.recipe
    step = max(1, recipe.batch * recipe.accum)
    return max(step, round(max(speeds) / 3600 * night.average_every_seconds))


def begin_share(night: ShareNight, share: Share, of: int):
    """A share's own round on the hub, registered before it trains; returns its hub."""
    share_hub = night.new_hub()
    share.out = str(night.job.for_share(share.index).out)
    share.hub_round = share_hub.register(
        night.student_id, 0, {**night.hub_recipe, "share": share.index, "of": of}
    )
    return share_hub


def shares_sized(trained: Trained, kept_back: int = 0) -> str:
    """The note that says how the slice was cut."""
    return (
        "shares sized by speed: "
        + ", ".join(
            f"share {s.index} {p} turns ({s.probe_turns_per_hour:.0f} turns/h)"
            for s, p in zip(trained.shares, trained.split, strict=True)
        )
        + (f"; {kept_back} turns kept for a machine that joins" if kept_back else "")
    )


def end_share(share: Share, share_hub) -> None:
    """A share's own round on the hub: its adapter, then its end."""
    summary = share.summary
    adapter = share_hub.put_adapter(Path(summary.best)) if summary else None
    share_hub.end(
        {
            "status": "done" if summary else "failed",
            "baseline": None,
            "result": None,
            "adapter": adapter,
            "why": f"share {share.index}: "
            + (
                f"trained {summary.turns_trained} turns ({summary.why})"
                if summary
                else str(share.lost)
            ),
            "trained": summary.turns_trained if summary else 0,
        }
    )


def stale_syncs(syncs: list[dict]) -> str:
    """What the round notes of the syncs counted in part for their staleness ("" if none)."""
    stale = [s["freshness"] for s in syncs if s.get("freshness", 1.0) < 1.0]
    if not stale:
        return ""
    return f"; {len(stale)} of them stale, counted in part (freshness down to {min(stale):.2f})"
