"""Where a round's work runs: Ray started (or joined), the device and the CPUs an actor asks for,
and the launch of trainer and examiner actors, each waited on while the owner may say stop."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from gbray.platform import available_cpus
from gbray.settings import ExamMode, Recipe, as_record

log = logging.getLogger(__name__)


class Stopped(Exception):
    """The owner asked the round to stop."""


def start_ray(address: str | None):
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # every progress line matters, even alike ones
    if not ray.is_initialized():
        if address:
            ray.init(address=address, include_dashboard=False, log_to_driver=True)
        else:
            ray.init(num_cpus=available_cpus(), include_dashboard=False, log_to_driver=True)
    return ray


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
    from gbray.results import ExamStopped

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


def launch_trainer(ray, model: str, start: str | None, recipe: Recipe, out: Path, log_path: Path,
                   hub, start_name: str, run_id: str, options: dict | None = None,
                   averaging: tuple | None = None):  # fmt: skip
    from gbray.actors import TrainerActor

    gpus = 1 if recipe.device == "cuda" else 0
    out.mkdir(parents=True, exist_ok=True)
    return TrainerActor.options(num_cpus=recipe.threads, num_gpus=gpus, **(options or {})).remote(
        model, start, as_record(recipe), str(out), str(log_path), hub.actor, start_name, run_id,
        averaging,
    )  # fmt: skip


def merge_task(folders: list[str], out: str, method: str, turns: list[int]) -> dict:
    """The merge, run as a Ray task (torch loads there, not in the driver); returns its report."""
    from gbray.merge import merge_folders

    return merge_folders([Path(f) for f in folders], Path(out), method, turns).as_dict()
