"""The Ray cluster (SPEC §9): Ray started or joined, every trainer in an actor of its own and
every exam in a fresh examiner actor, killed when its exam is done (an exam never shares a
process or an allocator with training), the merge as a Ray task (torch loads there, not in the
driver), and a shares night spread over the nodes.

Shares are placed by a placement group that spreads them over the nodes (packing onto one only
when there is no other, which the round notes). Every share first measures its speed on a few
turns and the parts are cut in proportion. A trainer whose process dies is restarted by Ray and
carries on from its last checkpoint; a share whose machine is gone and does not come back is
left out, named in the report with the reason, and the survivors are merged. A machine that
joins during the night gets a share of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

from gbray.platform import available_cpus
from gbray.results import ExamStopped, Stopped
from gbray.settings import ExamMode, Recipe, TrainerJob, as_record
from gbray.shares import (
    PROBE_TURNS,
    Share,
    ShareNight,
    Trained,
    begin_share,
    end_share,
    shares_sized,
    split_by_speed,
    sync_turns,
)

log = logging.getLogger(__name__)


class RayCluster:
    """A round's machines as Ray sees them: a local Ray, or the cluster at `address`."""

    def __init__(self, address: str | None):
        self.ray = start_ray(address)

    def resolve(self, recipe: Recipe) -> Recipe:
        seed = recipe.resolve("cpu").seed
        return dataclasses.replace(
            recipe.resolve(device_of(self.ray, recipe)),
            seed=seed,
            threads=actor_cpus(self.ray, recipe),
        )

    def hub(self, settings: dict):
        from gbray.actors import RayHub

        return RayHub(settings)

    def room_for(self, actors: int, threads: int) -> bool:
        return self.ray.available_resources().get("CPU", 0) >= threads * actors

    def exam(self, model, adapter, recipe, paper, log_path, hub) -> ExamLaunch:
        return ExamLaunch(self.ray, model, adapter, recipe, paper, log_path, hub)

    def train(self, job: TrainerJob, train: list[dict], val: list[dict], hub):
        trainer = launch_trainer(self.ray, job, hub)
        try:
            process = self.ray.get(trainer.process.remote())
            summary = get_or_stopped(
                self.ray, trainer.train.remote(self.ray.put(train), val), hub, "training"
            )
        finally:
            # Free its CPUs (and memory) for the examiner; everything it made is on disk.
            self.ray.kill(trainer, no_restart=True)
        return summary, process

    def train_shares(self, night, n, train, val, hub, note) -> Trained:
        return train_shares(self.ray, night, n, train, val, hub, note)

    def merge(self, folders: list[str], out: Path, method: str, weights: list[float]) -> dict:
        task = self.ray.remote(num_cpus=1)(merge_task)
        return self.ray.get(task.remote(folders, str(out), method, weights))


def start_ray(address: str | None):
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # every progress line matters, even alike ones
    if not ray.is_initialized():
        if address:
            try:
                probe_head(address)
                ray.init(address=address, include_dashboard=False, log_to_driver=True)
            except ConnectionError as e:
                raise ConnectionError(
                    f"no Ray cluster answers at --address {address} ({e}); start one there "
                    "with `ray start --head`, or leave --address out for a local Ray"
                ) from e
        else:
            ray.init(num_cpus=available_cpus(), include_dashboard=False, log_to_driver=True)
    return ray


def probe_head(address: str, seconds: float = 5.0) -> None:
    """Refuse a HOST:PORT where nothing listens, in seconds: Ray's own connect retries such an
    address for minutes (20 attempts of 5 s or more each). `auto` and `ray://` addresses are
    Ray's to resolve."""
    import socket

    if address in ("auto", "local") or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return  # not HOST:PORT: Ray's own error names it
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=seconds).close()
    except OSError as e:
        raise ConnectionError(f"nothing listens at {host}:{port}: {e.strerror or e}") from e


def actor_cpus(ray, recipe: Recipe) -> int:
    """CPUs (and so torch threads) for one actor: the setting, else the largest node's CPUs."""
    if recipe.threads > 0:
        return recipe.threads
    per_node = [n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive")]
    return max(1, int(max(per_node, default=1)))


def device_of(ray, recipe: Recipe) -> str:
    if recipe.device != "auto":
        return recipe.device
    return "cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"


def wait_unless_stopped(ray, refs: list, hub, what: str) -> None:
    """Wait for every ref, unless the owner says stop first: then Stopped, within a few seconds
    (the caller kills the actors, so nothing more is computed)."""
    pending = list(refs)
    while pending:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
        if pending and hub.stopped():
            raise Stopped(f"stopped by the owner during {what}")


def get_or_stopped(ray, ref, hub, what: str):
    wait_unless_stopped(ray, [ref], hub, what)
    try:
        return ray.get(ref)
    except ExamStopped as e:
        raise Stopped(f"stopped by the owner during {what}") from e


class ExamLaunch:
    """One exam in a fresh examiner actor, killed when the exam is done or the owner says stop."""

    def __init__(self, ray, model: str, adapter: str | None, recipe: Recipe, paper: list[dict],
                 log_path: Path, hub, options: dict | None = None):  # fmt: skip
        from gbray.actors import ExaminerActor

        self.ray = ray
        gpus = 1 if recipe.device == "cuda" else 0
        self.actor = ExaminerActor.options(
            num_cpus=recipe.threads, num_gpus=gpus, **(options or {})
        ).remote(
            model,
            adapter,
            recipe.weights_precision,
            recipe.threads,
            recipe.device,
            str(log_path),
            hub.actor,
        )
        self.ref = self.actor.exam.remote(
            paper, recipe.answer_budget, recipe.max_len, ExamMode.of(recipe)
        )

    def result(self, hub, what: str):
        try:
            return get_or_stopped(self.ray, self.ref, hub, f"the {what} exam")
        finally:
            self.kill()

    def kill(self) -> None:
        self.ray.kill(self.actor, no_restart=True)


def launch_trainer(ray, job: TrainerJob, hub, options: dict | None = None,
                   averaging: tuple | None = None):  # fmt: skip
    from gbray.actors import TrainerActor

    recipe = job.recipe
    gpus = 1 if recipe.device == "cuda" else 0
    job.out.mkdir(parents=True, exist_ok=True)
    return TrainerActor.options(num_cpus=recipe.threads, num_gpus=gpus, **(options or {})).remote(
        job.model, job.start, as_record(recipe), str(job.out), str(job.log_path), hub.actor,
        job.start_name, job.run_id, averaging,
    )  # fmt: skip


def merge_task(folders: list[str], out: str, method: str, turns: list[int]) -> dict:
    """The merge, run as a Ray task (torch loads there, not in the driver); returns its report."""
    from gbray.merge import merge_folders

    return merge_folders([Path(f) for f in folders], Path(out), method, turns).as_dict()


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
    ray, night: ShareNight, n: int, train: list[dict], val: list[dict], hub, what
) -> Trained:
    """Train `n` shares of `train` and return what each became. `hub` is the round's own hub
    (for its notes and the stop); `what` notes a line on it."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    recipe = night.job.recipe
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
    running = Running(ray, night, trained, hub, averager, what)
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
        what(shares_sized(trained, kept_back))
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
                averager.save.remote(trained.survivors[0].adapter, str(night.job.out / "merged"))
            )
        for share, share_hub in zip(trained.shares, running.hubs, strict=True):
            end_share(share, share_hub)
    finally:
        for actor in running.trainers + ([averager] if averager else []):
            ray.kill(actor, no_restart=True)
        remove_placement_group(pg)
    return trained


class Running:
    """The shares while they train: launching one (at the start, or on a machine that joined),
    and waiting for all, leaving out one whose machine went away."""

    def __init__(self, ray, night: ShareNight, trained: Trained, hub, averager, what):
        self.ray, self.night, self.trained = ray, night, trained
        self.hub, self.averager = hub, averager
        self.what = what  # a line on the round's log and hub
        self.trainers, self.hubs, self.pending = [], [], {}
        self.ends_at = 0.0
        self.kept_back: list[dict] = []
        self.val: list[dict] = []
        self.present: set[str] = set()
        self.began = time.monotonic()

    def launch(self, share: Share, strategy) -> None:
        night = self.night
        share_hub = begin_share(night, share, len(self.trained.shares))
        options = {
            "scheduling_strategy": strategy,
            **(night.options[share.index] if share.index < len(night.options) else {}),
        }
        averaging = (self.averager, share.index) if self.averager else None
        job = night.job.for_share(share.index)
        self.trainers.append(launch_trainer(self.ray, job, share_hub, options, averaging))
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

        ray, recipe = self.ray, self.night.job.recipe
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
        ray, night, shares = self.ray, self.night, self.trained.shares
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
        night.outer_lr, night.outer_momentum, night.pool_gradients, night.step_together
    )


def _wait_all(ray, refs, hub, what: str) -> list:
    pending = list(refs)
    while pending:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
        if pending and hub.stopped():
            raise Stopped(f"stopped by the owner during {what}")
    return ray.get(refs)
