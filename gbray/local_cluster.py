"""A round run in this process, one thing after another: the trainer, each exam (a fresh Examiner
every time, its model loaded anew), each share in turn, the merge. The same round as on Ray,
without Ray: its branches (the baseline's plan, lost shares, the merge's kind) get tests that
run in seconds.

An exam here shares the process (and the allocator) with the training before it, which a real
night avoids (SPEC §4); use RayCluster for a night whose numbers count.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from pathlib import Path

from gbray.averaging import Averager, LocalLink, save_merged
from gbray.merge import merge_folders
from gbray.platform import process_record
from gbray.results import ExamResult, ExamStopped, Stopped
from gbray.settings import ExamMode, Recipe, TrainerJob
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

NODE = "in-process"


def progress(log_path: Path, hub):
    """report(line): progress.log and the hub, as an actor's progress goes."""

    def report(line: str) -> None:
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
        hub.note(line)

    return report


class LocalCluster:
    """`threads`: torch threads for every trainer and exam (this process's). `room`: whether a
    baseline may wait beside the shares (here it is measured after them). `lose`: shares whose
    machine goes away once they have trained, with the reason (what they synced stays), as a
    node lost mid-night is on Ray."""

    def __init__(self, threads: int = 1, room: bool = False, lose: dict[int, str] | None = None):
        self.threads, self.room, self.lose = threads, room, dict(lose or {})

    def resolve(self, recipe: Recipe) -> Recipe:
        device = "cpu" if recipe.device == "auto" else recipe.device
        return dataclasses.replace(recipe.resolve(device), threads=recipe.threads or self.threads)

    def hub(self, settings: dict):
        from gbray.hub.client import ClientSettings, HubClient

        return HubClient(ClientSettings(**settings))

    def room_for(self, actors: int, threads: int) -> bool:
        return self.room

    def exam(self, model, adapter, recipe, paper, log_path, hub) -> LocalExam:
        return LocalExam(model, adapter, recipe, paper, Path(log_path))

    def train(self, job: TrainerJob, train: list[dict], val: list[dict], hub):
        summary = self.trainer(job, hub).train(train, val)
        gc.collect()
        return dataclasses.replace(summary, pid=os.getpid()), process_record()

    def trainer(self, job: TrainerJob, hub, sync=None):
        from gbray.trainer import Trainer

        job.out.mkdir(parents=True, exist_ok=True)
        return Trainer(
            job.model,
            job.start,
            job.recipe,
            job.out,
            report=progress(job.log_path, hub),
            on_check=hub.check,
            should_stop=hub.stopped,
            on_saved=lambda kind, path: hub.put_adapter(
                Path(path), None if kind in (None, "best") else kind
            ),
            start_name=job.start_name,
            run_id=job.run_id,
            sync=sync,
        )

    def train_shares(self, night: ShareNight, n, train, val, hub, note) -> Trained:
        """The shares in turn, each with the whole hours (as on n machines at once); with
        averaging, each syncs with one in-process averager, so a later share starts from what the
        earlier ones synced, as a machine that joins does on Ray."""
        trained = Trained([Share(i, node=NODE) for i in range(n)])
        trained.average_every_seconds = night.average_every_seconds
        hubs = [begin_share(night, share, n) for share in trained.shares]
        first = self.trainer(night.job.for_share(0), hubs[0])
        speed = first.probe(train[: PROBE_TURNS * max(1, night.job.recipe.batch)])
        del first
        for share in trained.shares:
            share.probe_turns_per_hour = round(speed, 1)
        trained.split = split_by_speed(len(train), [speed] * n)
        note(shares_sized(trained))
        averager = None
        if night.average_every_seconds > 0:
            averager = Averager(night.outer_lr, night.outer_momentum)
            averager.set_speeds(dict.fromkeys(range(n), speed))
        every = sync_turns(night, [speed]) if averager else float("inf")
        began, at = time.monotonic(), 0
        for share, part, share_hub in zip(trained.shares, trained.split, hubs, strict=True):
            if hub.stopped():
                raise Stopped("stopped by the owner during training")
            share.turns = part
            link = (
                LocalLink(averager, share.index, every, night.pool_gradients) if averager else None
            )
            trainer = self.trainer(night.job.for_share(share.index), share_hub, link)
            summary = trainer.train(train[at : at + part], val)
            at += part
            del trainer
            gc.collect()
            if summary.why == "stopped":
                raise Stopped("stopped by the owner during training")
            if share.index in self.lose:
                share.lost = self.lose[share.index]
                share.left_minute = round((time.monotonic() - began) / 60, 2)
                note(
                    f"share {share.index} left the night at minute {share.left_minute}: {share.lost}"
                )
                if averager:
                    averager.drop(share.index)
            else:
                share.trained(summary)
            end_share(share, share_hub)
        if averager and trained.survivors:
            trained.merged = save_merged(
                averager, every, Path(trained.survivors[0].adapter), night.job.out / "merged"
            )
        return trained

    def merge(self, folders: list[str], out: Path, method: str, weights: list[float]) -> dict:
        return merge_folders([Path(f) for f in folders], Path(out), method, weights).as_dict()


@dataclasses.dataclass
class LocalExam:
    """An exam run when its result is asked for, by a fresh Examiner in this process."""

    model: str
    adapter: str | None
    recipe: Recipe
    paper: list[dict]
    log_path: Path

    def result(self, hub, what: str) -> ExamResult:
        from gbray.examiner import Examiner

        r = self.recipe
        examiner = Examiner(
            self.model,
            self.adapter,
            r.weights_precision,
            r.threads,
            r.device,
            report=progress(self.log_path, hub),
            should_stop=hub.stopped,
        )
        try:
            return examiner.exam(self.paper, r.answer_budget, r.max_len, ExamMode.of(r))
        except ExamStopped as e:
            raise Stopped(f"stopped by the owner during the {what} exam") from e
        finally:
            del examiner
            gc.collect()
