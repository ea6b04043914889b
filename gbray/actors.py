"""Thin Ray shells over the trainer and the examiner: each builds the plain class in its own
process, with the thread count its CPUs allow, and forwards calls. No logic lives here."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import ray


def _progress_sink(log_path: str):
    """report(line): to this process's log (Ray forwards it to the driver) and to progress.log."""
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

    return report


@ray.remote(max_restarts=0, max_task_retries=0)
class TrainerActor:
    def __init__(self, model: str, adapter: str | None, recipe: dict, out: str, log_path: str):
        from gbray.platform import process_record
        from gbray.settings import Recipe
        from gbray.trainer import Trainer

        self.record = process_record()
        self.trainer = Trainer(
            model, adapter, Recipe(**recipe), Path(out), report=_progress_sink(log_path)
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
    ):
        from gbray.examiner import Examiner

        self.examiner = Examiner(
            model, adapter, precision, threads, device, report=_progress_sink(log_path)
        )

    def pid(self) -> int:
        return os.getpid()

    def exam(self, turns: list[dict], answer_budget: int, max_len: int, batch: int) -> dict:
        return self.examiner.exam(turns, answer_budget, max_len, batch)
