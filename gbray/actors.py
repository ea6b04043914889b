"""Thin Ray shells over the trainer, the examiner and the hub client: each builds the plain class
in its own process, with the thread count its CPUs allow, and forwards calls. No logic lives here
beyond wiring `report`, `on_check` and `should_stop` to the hub actor."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import ray

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


@ray.remote(max_restarts=0, max_task_retries=0)
class TrainerActor:
    def __init__(
        self, model: str, adapter: str | None, recipe: dict, out: str, log_path: str, hub=None
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
        )

    def pid(self) -> int:
        return os.getpid()

    def process(self) -> dict:
        return self.record

    def train(self, train_turns: list[dict], val_turns: list[dict]) -> dict:
        summary = self.trainer.train(train_turns, val_turns)
        summary["pid"] = os.getpid()
        return summary


@ray.remote(max_restarts=0, max_task_retries=0)
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

    def exam(self, turns: list[dict], answer_budget: int, max_len: int, batch: int) -> dict:
        return self.examiner.exam(turns, answer_budget, max_len, batch)


@ray.remote(max_restarts=0, max_task_retries=0, concurrency_groups={"slow": 2})
class HubActor:
    """The round's one hub client. Notes, checks and stop polls share the default group (one
    thread, so one caller's notes stay in order); uploads and other driver calls run in their own
    threads, so a long upload does not hold up notes."""

    def __init__(self, settings: dict):
        from gbray.hub.client import ClientSettings, HubClient

        logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
        self.client = HubClient(ClientSettings(**settings))

    @ray.method(concurrency_group="slow")
    def call(self, method: str, *args):
        return getattr(self.client, method)(*args)

    def note(self, line: str) -> bool:
        return self.client.note(line)

    def check(self, point: dict) -> bool:
        return self.client.check(point)

    def stopped(self) -> bool:
        return self.client.stopped()

    @ray.method(concurrency_group="slow")
    def put_adapter(self, folder: str, part: str | None = None) -> str | None:
        return self.client.put_adapter(Path(folder), None if part in (None, "best") else part)
