"""Shares (SPEC §9): several trainers train disjoint parts of one slice from the same start, on
different machines where the cluster has them, and their adapters are merged.

Placement is a Ray placement group that spreads the shares over the nodes (packing onto one only
when there is no other, which the round notes). Machines differ by 100x, so every share first
measures its speed on a few turns, and the parts are cut in proportion: every share ends inside
the hours with its epochs done, none idle while another has turns left. A trainer whose process
dies is restarted by Ray and carries on from its last checkpoint; a share whose machine is gone
and does not come back is left out, named in the report with the reason, and the survivors are
merged. One share is the plain round: no placement group, no probe.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gbray.placement import Stopped, launch_trainer
from gbray.results import TrainSummary
from gbray.settings import Recipe

log = logging.getLogger(__name__)

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

    ray: object
    model: str
    start: str | None
    start_name: str
    recipe: Recipe
    out: Path
    new_hub: Callable  # () -> Hub: each share reports as a round of its own
    hub_recipe: dict
    student_id: str
    run_id: str = ""
    grace_seconds: float = 120.0
    average_every_seconds: float = 0.0  # 0: the shares meet only in the merge
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    joins: bool = False  # keep a part of the slice back for a machine that joins
    options: list[dict] = field(default_factory=list)  # per share: extra actor options (tests)


def _bundle_nodes(ray, pg) -> list[str]:
    from ray.util.placement_group import placement_group_table

    table = placement_group_table(pg)
    return [table["bundles_to_node_id"][i] for i in range(len(table["bundles"]))]


def _answers(ray, actor, seconds: float = 2.0) -> bool:
    """Whether the actor answers a ping within `seconds` (a trainer answers while it trains: it
    runs two calls at once). One restarting, or waiting for a machine, does not."""
    ping = actor.pid.remote()
    ready, _ = ray.wait([ping], timeout=seconds)
    if not ready:
        return False
    try:
        ray.get(ping)
    except Exception:  # noqa: BLE001 - a dead actor's ping raises; it does not answer
        return False
    return True


def train_shares(
    night: ShareNight, n: int, train: list[dict], val: list[dict], hub, what
) -> Trained:
    """Train `n` shares of `train` and return what each became. `hub` is the round's own hub
    (for its notes and the stop); `what` notes a line on it."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray, recipe = night.ray, night.recipe
    bundle = {"CPU": recipe.threads, **({"GPU": 1} if recipe.device == "cuda" else {})}
    present = {x["NodeID"] for x in ray.nodes() if x.get("Alive")}
    pg = placement_group([bundle] * n, strategy="SPREAD")
    if not pg.wait(timeout_seconds=60):
        remove_placement_group(pg)
        raise RuntimeError(
            f"the cluster cannot hold {n} shares of {bundle} (resources: {ray.cluster_resources()})"
        )
    nodes = _bundle_nodes(ray, pg)
    trained = Trained([Share(i, node=nodes[i]) for i in range(n)])
    trained.average_every_seconds = night.average_every_seconds
    alive_nodes = len(present)
    if len(set(nodes)) < n:
        trained.packed_note = (
            f"{n} shares packed onto {len(set(nodes))} machine(s): the cluster has "
            f"{alive_nodes} with room for one"
        )
        what(trained.packed_note)
    averager = _start_averager(ray, night)
    running = Running(night, trained, hub, averager, what)
    try:
        for share in trained.shares:
            running.launch(share, PlacementGroupSchedulingStrategy(pg, share.index))
        # Every share measures its own speed, then the parts are cut in proportion. With joins
        # on, a part of the slice is kept back for a machine that joins during the night.
        sample = train[: PROBE_TURNS * max(1, recipe.batch)]
        speeds = _wait_all(
            ray, [t.probe.remote(sample) for t in running.trainers], hub, "the speed probe"
        )
        for share, speed in zip(trained.shares, speeds, strict=True):
            share.probe_turns_per_hour = round(speed, 1)
        kept_back = len(train) // (n + 1) if averager and night.joins else 0
        trained.split = split_by_speed(len(train) - kept_back, speeds)
        if averager:
            ray.get(
                averager.set_every_turns.remote(sync_turns(night, speeds), dict(enumerate(speeds)))
            )
        what(
            "shares sized by speed: "
            + ", ".join(
                f"share {s.index} {p} turns ({s.probe_turns_per_hour:.0f} turns/h)"
                for s, p in zip(trained.shares, trained.split, strict=True)
            )
            + (f"; {kept_back} turns kept for a machine that joins" if kept_back else "")
        )
        # One clock for the night: every share's budget ends at the same moment, so they all
        # cool down together (gbray.schedule), whatever their speed.
        running.ends_at = time.time() + recipe.hours * 3600
        at = 0
        for share, part in zip(trained.shares, trained.split, strict=True):
            running.train(share, train[at : at + part], val)
            at += part
        running.kept_back = train[at:]
        running.present = present
        running.wait()
        if averager and trained.survivors:
            trained.merged = ray.get(
                averager.save.remote(trained.survivors[0].adapter, str(night.out / "merged"))
            )
        for share, share_hub in zip(trained.shares, running.hubs, strict=True):
            _end_share(share, share_hub)
    finally:
        for actor in running.trainers + ([averager] if averager else []):
            ray.kill(actor, no_restart=True)
        remove_placement_group(pg)
    return trained


class Running:
    """The shares while they train: launching one (at the start, or on a machine that joined),
    and waiting for all, leaving out one whose machine went away."""

    def __init__(self, night: ShareNight, trained: Trained, hub, averager, what):
        self.night, self.trained, self.hub, self.averager = night, trained, hub, averager
        self.what = what  # a line on the round's log and hub
        self.trainers, self.hubs, self.pending = [], [], {}
        self.ends_at = 0.0
        self.kept_back: list[dict] = []
        self.val: list[dict] = []
        self.present: set[str] = set()
        self.began = time.monotonic()

    def launch(self, share: Share, strategy) -> None:
        night = self.night
        share_hub = night.new_hub()
        share.out = str(night.out / f"share-{share.index}")
        share.hub_round = share_hub.register(
            night.student_id,
            0,
            {**night.hub_recipe, "share": share.index, "of": len(self.trained.shares)},
        )
        options = {
            "scheduling_strategy": strategy,
            **(night.options[share.index] if share.index < len(night.options) else {}),
        }
        self.trainers.append(
            launch_trainer(
                night.ray,
                night.model,
                night.start,
                night.recipe,
                Path(share.out),
                Path(share.out) / "progress.log",
                share_hub,
                night.start_name,
                f"{night.run_id}-share-{share.index}",
                options,
                (self.averager, share.index) if self.averager else None,
            )  # fmt: skip
        )
        self.hubs.append(share_hub)

    def train(self, share: Share, turns: list[dict], val: list[dict]) -> None:
        share.turns, self.val = len(turns), val
        trainer = self.trainers[share.index]
        self.pending[share.index] = trainer.train.remote(turns, val, self.ends_at)

    def minute(self) -> float:
        return round((time.monotonic() - self.began) / 60, 2)

    def welcome_joiners(self) -> None:
        """A machine that joined the cluster since the night began gets a share of its own: the
        turns kept back, from the current global adapter (Ray has no node-joined event: its
        node list is read at every look)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ray, recipe = self.night.ray, self.night.recipe
        cooldown = recipe.cooldown * recipe.hours * 3600
        if not self.kept_back or time.time() > self.ends_at - cooldown:
            return  # a machine that joins during the cool-down has nothing to add
        for node in ray.nodes():
            if not node.get("Alive") or node["NodeID"] in self.present:
                continue
            self.present.add(node["NodeID"])
            if node["Resources"].get("CPU", 0) < recipe.threads:
                continue
            share = Share(len(self.trained.shares), node=node["NodeID"])
            share.joined_minute = self.minute()
            self.trained.shares.append(share)
            self.launch(share, NodeAffinitySchedulingStrategy(node["NodeID"], soft=False))
            turns, self.kept_back = self.kept_back, []
            self.train(share, turns, self.val)
            line = (
                f"a machine joined ({node['NodeID'][:12]}, minute {share.joined_minute}): share "
                f"{share.index} trains the {len(turns)} turns kept back, from the current average"
            )
            self.what(line)
            return

    def wait(self) -> None:
        """Wait for every share; one whose actor died, or whose machine has been gone past the
        grace once another share finished, is left out with the reason (what it synced stays)."""
        ray, night, shares = self.night.ray, self.night, self.trained.shares
        gone_since: dict[int, float] = {}
        finished = 0
        while self.pending:
            done, _ = ray.wait(list(self.pending.values()), num_returns=1, timeout=1.0)
            if self.hub.stopped():
                raise Stopped("stopped by the owner during training")
            for i, ref in list(self.pending.items()):
                if ref not in done:
                    continue
                del self.pending[i]
                finished += 1
                try:
                    shares[i].trained(ray.get(ref))
                except Exception as e:  # noqa: BLE001 - a lost share is a value in the report
                    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    self.lose(i, f"its trainer died: {type(e).__name__}: {reason[:300]}")
            if self.averager:
                self.welcome_joiners()
            if not self.pending or not finished:
                continue
            # Someone finished: a share whose actor is not alive gets the grace, then is left out.
            now = time.monotonic()
            for i in list(self.pending):
                if _answers(ray, self.trainers[i]):
                    gone_since.pop(i, None)
                    continue
                since = gone_since.setdefault(i, now)
                if now - since > night.grace_seconds:
                    self.lose(
                        i,
                        f"its machine went away ({shares[i].node}) and it did not come back "
                        f"within {night.grace_seconds:.0f} s",
                    )
                    del self.pending[i]

    def lose(self, i: int, why: str) -> None:
        share = self.trained.shares[i]
        share.lost, share.left_minute = why, self.minute()
        log.warning("share %d lost: %s", i, why)
        self.what(f"share {i} left the night at minute {share.left_minute}: {why}")
        if self.averager:
            self.averager.drop.remote(i)


def _start_averager(ray, night: ShareNight):
    """The averager lives on the driver's machine: a round that lost it has lost its driver."""
    if night.average_every_seconds <= 0:
        return None
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from gbray.actors import AveragerActor

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return AveragerActor.options(scheduling_strategy=here).remote(
        night.outer_lr, night.outer_momentum
    )


def sync_turns(night: ShareNight, speeds: list[float]) -> int:
    """Turns between a share's syncs: what the fastest share trains in the interval, at least
    one optimizer step's (so a share three times slower syncs three times less often)."""
    step = max(1, night.recipe.batch * night.recipe.accum)
    return max(step, round(max(speeds) / 3600 * night.average_every_seconds))


def _wait_all(ray, refs, hub, what: str) -> list:
    pending = list(refs)
    while pending:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
        if pending and hub.stopped():
            raise Stopped(f"stopped by the owner during {what}")
    return ray.get(refs)


def _end_share(share: Share, share_hub) -> None:
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
