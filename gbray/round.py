"""One round's backbone (SPEC §4): work, baseline, train, exam, report. Then stop.

The driver stays light (no torch): the trainer runs in one actor, and every exam in a fresh
examiner actor that is killed when its exam is done, so an exam never shares a process or an
allocator with training. Promotion is not the round's business.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import time
from pathlib import Path

from gbray.data.sampler import draw
from gbray.data.turns import TurnIndex, index_folder
from gbray.platform import available_cpus, process_record
from gbray.settings import Recipe, RoundSettings, as_record

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Work:
    """What a round trains and is examined on."""

    train: list[dict]
    val: list[dict]
    paper: list[dict]
    paper_id: str
    scope: str
    bad_lines: dict


def paper_of(evaluation: TurnIndex, turns: int) -> tuple[list[dict], str]:
    """The fixed paper: the first `turns` usable eval turns; its id is a hash of their lines."""
    paper = evaluation.read(list(range(min(turns, len(evaluation)))))
    digest = hashlib.sha256()
    for turn in paper:
        digest.update(json.dumps(turn, sort_keys=True).encode())
    return paper, "p-" + digest.hexdigest()[:12]


def validation_positions(train: TurnIndex, slice_: list[int], want: int, seed: int) -> list[int]:
    """Held-out turns for the validation loss: outside the slice, from jobs outside it first."""
    taken = set(slice_)
    jobs = {train.jobs[i] for i in slice_}
    rest = [i for i in range(len(train)) if i not in taken]
    random.Random(seed).shuffle(rest)
    rest.sort(key=lambda i: train.jobs[i] in jobs)  # stable: other jobs first, still shuffled
    return rest[:want]


def local_work(data: Path, train: TurnIndex, evaluation: TurnIndex, recipe: Recipe) -> Work:
    paper, paper_id = paper_of(evaluation, recipe.exam_turns)
    want = min(recipe.turns, len(train) - min(recipe.val_turns, len(train) // 5))
    picked = draw(train.tools, train.tiers, want, seed=recipe.seed)
    val_at = validation_positions(train, picked, recipe.val_turns, recipe.seed)
    work = Work(
        train.read(picked),
        train.read(val_at),
        paper,
        paper_id,
        scope=f"local:{data.resolve()}",
        bad_lines={"train": train.bad.as_dict(), "eval": evaluation.bad.as_dict()},
    )
    log.info(
        "slice: %d turns (seed %d), %d validation turns, paper %s of %d turns; bad lines: %d train, %d eval",
        len(work.train),
        recipe.seed,
        len(work.val),
        paper_id,
        len(paper),
        train.bad.total,
        evaluation.bad.total,
    )
    return work


def _start_ray(address: str | None):
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # every progress line matters, even alike ones
    if not ray.is_initialized():
        if address:
            ray.init(address=address, include_dashboard=False, log_to_driver=True)
        else:
            ray.init(num_cpus=available_cpus(), include_dashboard=False, log_to_driver=True)
    return ray


def _actor_cpus(ray, recipe: Recipe) -> int:
    """CPUs (and so torch threads) for one actor: the setting, else the largest node's CPUs."""
    if recipe.threads > 0:
        return recipe.threads
    per_node = [n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive")]
    return max(1, int(max(per_node, default=1)))


def _device(ray, recipe: Recipe) -> str:
    if recipe.device != "auto":
        return recipe.device
    return "cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"


def run_exam(
    ray,
    model: str,
    adapter: str | None,
    recipe: Recipe,
    paper: list[dict],
    log_path: Path,
    what: str,
) -> dict:
    """One exam in a fresh examiner actor, killed when the exam is done, whatever happened."""
    from gbray.actors import ExaminerActor

    gpus = 1 if recipe.device == "cuda" else 0
    actor = ExaminerActor.options(num_cpus=recipe.threads, num_gpus=gpus).remote(
        model, adapter, recipe.precision, recipe.threads, recipe.device, str(log_path)
    )
    try:
        log.info("%s exam: %d turns, answer budget %d", what, len(paper), recipe.answer_budget)
        result = ray.get(
            actor.exam.remote(paper, recipe.answer_budget, recipe.max_len, recipe.exam_batch)
        )
        log.info(
            "%s: %.1f%% agreement (%d/%d)",
            what,
            result["agreement"],
            result["right"],
            result["turns"],
        )
        return result
    finally:
        ray.kill(actor, no_restart=True)


def new_round_id() -> str:
    return time.strftime("r-%Y%m%d-%H%M%S-") + os.urandom(2).hex()


def run_round(settings: RoundSettings) -> dict:
    """Run one round; returns round.json's content (also written to settings.out/round.json)."""
    settings.validate()
    started = time.time()
    round_id = new_round_id()
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "progress.log"
    # Bad data ends the round before anything starts: indexing reads raw lines only.
    train, evaluation = index_folder(Path(settings.data))
    seed = settings.recipe.resolve("cpu").seed
    ray = _start_ray(settings.address)
    device = _device(ray, settings.recipe)
    recipe = dataclasses.replace(
        settings.recipe.resolve(device),
        seed=seed,
        threads=_actor_cpus(ray, settings.recipe),
    )
    (out / "recipe.json").write_text(json.dumps(as_record(recipe), indent=2))
    work = local_work(Path(settings.data), train, evaluation, recipe)
    model = str(Path(settings.model).resolve())
    start_name = settings.adapter or "bare"
    record: dict = {
        "round": round_id,
        "device": device,
        "student": model,
        "carried_from": settings.adapter,
        "start": start_name,
        "draw_seed": recipe.seed,
        "recipe": as_record(recipe),
        "paper": {"id": work.paper_id, "scope": work.scope, "turns": len(work.paper)},
        "slice_turns": len(work.train),
        "val_turns": len(work.val),
        "bad_lines": work.bad_lines,
        "driver": process_record(),
        "progress_log": str(log_path),
        "status": "running",
    }

    def write() -> None:
        (out / "round.json").write_text(json.dumps(record, indent=2, default=str))

    write()
    # A freshly wrapped LoRA equals the bare start, so the baseline needs no trained model.
    try:
        baseline = run_exam(ray, model, settings.adapter, recipe, work.paper, log_path, "baseline")
    except Exception as e:  # noqa: BLE001 - a crashed exam costs only that exam
        log.error("baseline exam failed: %s", e)
        baseline = None
        record["baseline_error"] = str(e)
    record["baseline"] = baseline
    record["exam_pids"] = [baseline["pid"]] if baseline else []
    write()

    from gbray.actors import TrainerActor

    gpus = 1 if device == "cuda" else 0
    trainer = TrainerActor.options(num_cpus=recipe.threads, num_gpus=gpus).remote(
        model, settings.adapter, as_record(recipe), str(out), str(log_path)
    )
    try:
        record["trainer_pid"] = ray.get(trainer.pid.remote())
        record["trainer_process"] = ray.get(trainer.process.remote())
        train_ref = ray.put(work.train)
        summary = ray.get(trainer.train.remote(train_ref, work.val))
    except Exception as e:
        record.update(
            status="failed",
            why=f"training failed: {e}",
            minutes=round((time.time() - started) / 60, 2),
        )
        last = out / "last"
        record["adapter_last"] = str(last) if (last / "adapter_config.json").is_file() else None
        write()
        raise
    finally:
        # Free its CPUs (and memory) for the examiner; everything it made is on disk.
        ray.kill(trainer, no_restart=True)
    record.update(
        steps=summary["steps"],
        planned_steps=summary["planned_steps"],
        replanned_from=summary["replanned_from"],
        best_val_loss=summary["best_val_loss"],
        best_step=summary["best_step"],
        checks=summary["checks"],
        turns_trained=summary["turns_trained"],
        turn_passes=summary["turn_passes"],
        epochs_done=summary["epochs_done"],
        why=summary["why"],
        mean_loss=summary["mean_loss"],
        skipped_nan=summary["skipped_nan"],
        shortened=summary["shortened"],
        training_minutes=summary["minutes"],
        adapter=summary["best"],
        adapter_last=summary["last"],
    )
    write()
    try:
        result = run_exam(ray, model, summary["best"], recipe, work.paper, log_path, "result")
        record["exam_pids"].append(result["pid"])
    except Exception as e:  # noqa: BLE001 - the adapter is already on disk
        log.error("result exam failed: %s", e)
        result = None
        record["result_error"] = str(e)
    record["result"] = result
    record["beat"] = bool(baseline and result and result["agreement"] > baseline["agreement"])
    record["status"] = "ended" if result is not None else "exam failed"
    record["minutes"] = round((time.time() - started) / 60, 2)
    write()
    return record


def summary_line(record: dict, out: Path) -> dict:
    def agreement(key):
        exam = record.get(key)
        return exam["agreement"] if exam else None

    return {
        "round_json": str(Path(out) / "round.json"),
        "baseline": agreement("baseline"),
        "result": agreement("result"),
        "beat": record.get("beat", False),
        "status": record.get("status"),
    }
