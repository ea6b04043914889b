"""Thin Ray shells over the trainer, the examiner and the hub client: each builds the plain class
in its own process, with the thread count its CPUs allow, and forwards calls. No logic lives here
beyond wiring `report`, `on_check` and `should_stop` to the hub actor."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import ray

if TYPE_CHECKING:
    from gbray.peers import Posted

STOP_POLL_SECONDS = 3.0


def _progress_sink(log_path: str, hub=None):
    """report(line): this process's log (Ray forwards it to the driver), progress.log, the hub."""
    import warnings

    from transformers.utils import logging as hf_logging

    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    hf_logging.disable_progress_bar()
    warnings.filterwarnings(
        "ignore", category=FutureWarning
    )  # deprecations inside peft/transformers
    logger = logging.getLogger("gbray.progress")

    def report(line: str) -> None:
        logger.info(line)
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
        if hub is not None:
            hub.note.remote(line)  # in order: one caller's calls to an actor run in order

    return report


def _stop_poll(hub):
    """should_stop(): asks the hub actor at most every few seconds."""
    state = {"at": 0.0, "stop": False}

    def should_stop() -> bool:
        if hub is None or state["stop"]:
            return state["stop"]
        if time.monotonic() - state["at"] >= STOP_POLL_SECONDS:
            state["at"] = time.monotonic()
            state["stop"] = ray.get(hub.stopped.remote())
        return state["stop"]

    return should_stop


# A trainer Ray restarts (its process crashed, or its node came back) carries on from its last
# checkpoint: the train call is run again and finds OUT/last/resume.pt.
@ray.remote(max_restarts=1, max_task_retries=1, max_concurrency=2)
class TrainerActor:
    def __init__(
        self,
        model: str,
        adapter: str | None,
        recipe: dict,
        out: str,
        log_path: str,
        hub=None,
        start_name: str | None = None,
        run_id: str | None = None,
        averaging: tuple | None = None,  # (AveragerActor, this share's index)
    ):
        from gbray.platform import process_record
        from gbray.settings import Recipe
        from gbray.trainer import Trainer

        self.record = process_record()
        self.trainer = Trainer(
            model,
            adapter,
            Recipe(**recipe),
            Path(out),
            report=_progress_sink(log_path, hub),
            on_check=(lambda point: hub.check.remote(point))
            if hub is not None
            else (lambda point: None),
            should_stop=_stop_poll(hub),
            on_saved=(lambda kind, path: hub.put_adapter.remote(str(path), kind))
            if hub is not None
            else (lambda kind, path: None),
            start_name=start_name,
            # A slower machine, simulated: set in the actor's runtime_env by tests of shares.
            pause_per_turn=float(os.environ.get("GBRAY_SIMULATED_SLOWDOWN", "0") or 0),
            run_id=run_id,
            sync=AveragerLink(*averaging) if averaging else None,
        )

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def process(self) -> dict:
        return self.record

    def resumed(self) -> dict | None:
        """The step and optimizer digest this trainer carried on from, if it resumed."""
        return self.trainer.resumed

    def probe(self, turns: list[dict]) -> float:
        return self.trainer.probe(turns)

    def train(self, train_turns: list[dict], val_turns: list[dict], ends_at: float | None = None):
        from dataclasses import replace

        return replace(self.trainer.train(train_turns, val_turns, ends_at), pid=os.getpid())


class AveragerLink:
    """A share's side of the night's averaging (the trainer's `sync`): a sync is due every
    `every_turns` turns it trains (the driver sets them from the fastest share's speed, so a slow
    share syncs less often); each is one call to the averager actor. Pooled gradients go through
    the averager too, or, stepping together (`--step-together`), through the group's all-reduce
    (`gbray.peers`), made as the share joins."""

    def __init__(self, averager, index: int):
        from gbray.peers import NO_POST

        self.averager, self.index = averager, index
        self.every_turns = float("inf")
        self.pools = False
        self.together = None
        self.posted = NO_POST  # the group's last post this share took

    def join(self, weights: dict) -> dict:
        from gbray.peers import Together

        self.every_turns, self.pools, place = ray.get(self.averager.plan.remote(self.index))
        self.together = Together(
            place,
            ray.util.get_node_ip_address(),
            post=lambda address: ray.get(self.averager.post_meeting.remote(address)),
            fetch=lambda: ray.get(self.averager.meeting_point.remote()),
            on_left=self._left_group,
        )
        self.pools = self.pools or self.together.stepping
        return ray.get(self.averager.join.remote(self.index, weights))

    def _left_group(self, why: str) -> None:
        self.pools = False
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(self.averager.leave_group.remote(self.index, why, self.posted.number))

    def due(self, turns_since: int) -> bool:
        if self.together.stepping:
            return self.together.post_due(self.every_turns)
        return turns_since >= self.every_turns

    def exchange(self, weights: dict, turns: int) -> dict:
        """A sync. Stepping together, the group syncs as one (`Averager.post_group`): one member
        hands in the weights they all hold, and nobody waits or takes anything back."""
        try:
            if self.together.stepping:
                self.posted = self.together.post(
                    weights,
                    lambda *post: ray.get(self.averager.post_group.remote(self.index, *post)),
                )
                return weights
            return ray.get(self.averager.exchange.remote(self.index, weights, turns, self.posted))
        except ray.exceptions.RayError as e:  # the driver's machine gone: train on alone
            logging.getLogger(__name__).warning("no averaging: %s", str(e).splitlines()[0])
            self.every_turns, self.pools = float("inf"), False
            # Its partners' all-reduce then fails at once, where it would wait out its timeout.
            self.together.close()
            return weights

    def pool(self, grads: dict, turns: int) -> tuple[dict, int]:
        if self.together.stepping:
            return self.together.pool(grads, turns)
        try:
            return ray.get(self.averager.pool.remote(self.index, grads, turns))
        except ray.exceptions.RayError as e:  # the driver's machine gone: train on alone
            logging.getLogger(__name__).warning("no pooling: %s", str(e).splitlines()[0])
            self.every_turns, self.pools = float("inf"), False
            return grads, turns

    def leave(self, weights: dict | None, turns: int) -> None:
        if self.together is not None:  # a partner still stepping stops waiting for this one
            self.together.close()
        # Waited on: the driver reads the global once every share's train call has returned.
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(self.averager.leave.remote(self.index, weights, turns, self.posted))


@ray.remote(num_cpus=0, max_concurrency=64)
class AveragerActor:
    def __init__(
        self, outer_lr: float, outer_momentum: float, pools: bool = False, together: bool = False
    ):
        from gbray.averaging import Averager

        self.averager = Averager(outer_lr, outer_momentum, together=together)
        self.every = float("inf")
        self.pools = pools

    def set_every_turns(self, turns: int, speeds: dict[int, float]) -> None:
        self.every = turns
        self.averager.set_speeds(speeds)

    def plan(self, index: int) -> tuple[float, bool, tuple[int, int] | None]:
        """For a share: turns between syncs, whether it pools its steps' gradients through the
        averager, and its place in the group stepping together (rank, size), if it is in it. A
        share outside the group when shares step together does not pool."""
        place = self.averager.place(index)
        return self.every, self.pools and not self.averager.together, place

    def post_meeting(self, address: tuple[str, int]) -> None:
        self.averager.post_meeting(address)

    def meeting_point(self) -> tuple[str, int] | None:
        return self.averager.meeting_point()

    def leave_group(self, index: int, why: str, posted: int = 0) -> None:
        self.averager.leave_group(index, why, posted)

    def join(self, index: int, weights: dict) -> dict:
        return self.averager.join(index, weights)

    def exchange(self, index: int, weights: dict, turns: int, posted: Posted) -> dict:
        return self.averager.exchange(index, weights, turns, posted)

    def post_group(self, index: int, weights: dict, turns: list[int], number: int) -> None:
        self.averager.post_group(index, weights, turns, number)

    def pool(self, index: int, grads: dict, turns: int) -> tuple[dict, int]:
        return self.averager.pool(index, grads, turns)

    def leave(self, index: int, weights: dict | None, turns: int, posted: Posted) -> None:
        self.averager.leave(index, weights, turns, posted)

    def drop(self, index: int) -> None:
        self.averager.drop(index)

    def save(self, template: str, out: str) -> dict:
        """The global adapter written to `out` (on the driver's machine); what round.json keeps."""
        from gbray.averaging import save_merged

        return {
            **save_merged(self.averager, self.every, Path(template), Path(out)),
            "pool_gradients": self.pools,
            "step_together": self.averager.together,
        }


# An exam is pure, so a lost examiner (its machine gone before or while it ran) is started
# again once on a live node and the exam asked again. The retries are unbounded because a
# machine that is gone but not yet known dead answers "unavailable" to each try; the one restart
# bounds them. An error inside the exam is not retried.
@ray.remote(max_restarts=1, max_task_retries=-1)
class ExaminerActor:
    def __init__(
        self,
        model: str,
        adapter: str | None,
        precision: str,
        threads: int,
        device: str,
        log_path: str,
        hub=None,
    ):
        from gbray.examiner import Examiner

        self.examiner = Examiner(
            model,
            adapter,
            precision,
            threads,
            device,
            report=_progress_sink(log_path, hub),
            should_stop=_stop_poll(hub),
        )

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def exam(self, turns: list[dict], answer_budget: int, max_len: int, mode):
        return self.examiner.exam(turns, answer_budget, max_len, mode)


@ray.remote(max_restarts=0, max_task_retries=0, concurrency_groups={"slow": 2})
class HubActor:
    """One round's hub client. Notes, checks and stop polls share the default group (one
    thread, so one caller's notes stay in order); uploads and the driver's other calls run in
    their own threads, so a long upload does not hold up notes."""

    def __init__(self, settings: dict):
        from gbray.hub.client import ClientSettings, HubClient

        logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
        self.client = HubClient(ClientSettings(**settings))

    def note(self, line: str) -> bool:
        return self.client.note(line)

    def check(self, point: dict) -> bool:
        return self.client.check(point)

    def stopped(self) -> bool:
        return self.client.stopped()

    @ray.method(concurrency_group="slow")
    def register(self, base: str, turns: int, recipe: dict) -> str | None:
        return self.client.register(base, turns, recipe)

    @ray.method(concurrency_group="slow")
    def slice(self, turns: int):
        return self.client.slice(turns)

    @ray.method(concurrency_group="slow")
    def paper(self, turns: int):
        return self.client.paper(turns)

    @ray.method(concurrency_group="slow")
    def ask_baseline(self, key: dict):
        return self.client.ask_baseline(key)

    @ray.method(concurrency_group="slow")
    def tell_baseline(self, key: dict, exam: dict) -> None:
        return self.client.tell_baseline(key, exam)

    @ray.method(concurrency_group="slow")
    def serving(self) -> dict | None:
        return self.client.serving()

    @ray.method(concurrency_group="slow")
    def get_adapter(self, name: str, into: str) -> str:
        return str(self.client.get_adapter(name, Path(into)))

    @ray.method(concurrency_group="slow")
    def put_adapter(self, folder: str, part: str | None = None) -> str | None:
        return self.client.put_adapter(Path(folder), None if part in (None, "best") else part)

    @ray.method(concurrency_group="slow")
    def end(self, body: dict) -> bool:
        return self.client.end(body)


class RayHub:
    """The `Hub` a round with a hub holds: its client lives in a HubActor, so trainers and
    examiners on any node report through the same one."""

    def __init__(self, settings: dict):
        self.actor = HubActor.remote(settings)

    def register(self, base: str, turns: int, recipe: dict) -> str | None:
        return ray.get(self.actor.register.remote(base, turns, recipe))

    def note(self, line: str) -> None:
        self.actor.note.remote(line)

    def check(self, point: dict) -> bool:
        return ray.get(self.actor.check.remote(point))

    def stopped(self) -> bool:
        return ray.get(self.actor.stopped.remote())

    def slice(self, turns: int):
        return ray.get(self.actor.slice.remote(turns))

    def paper(self, turns: int):
        return ray.get(self.actor.paper.remote(turns))

    def ask_baseline(self, key: dict):
        return ray.get(self.actor.ask_baseline.remote(key))

    def tell_baseline(self, key: dict, exam: dict) -> None:
        ray.get(self.actor.tell_baseline.remote(key, exam))

    def serving(self) -> dict | None:
        return ray.get(self.actor.serving.remote())

    def get_adapter(self, name: str, into: Path) -> Path:
        return Path(ray.get(self.actor.get_adapter.remote(name, str(into))))

    def put_adapter(self, folder: Path, part: str | None = None) -> str | None:
        return ray.get(self.actor.put_adapter.remote(str(folder), part))

    def end(self, body: dict) -> bool:
        return ray.get(self.actor.end.remote(body))
