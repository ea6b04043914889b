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
from gbray.data.turns import DataError, TurnIndex, index_folder
from gbray.platform import available_cpus, process_record
from gbray.settings import Recipe, RoundSettings, as_record, locate_model

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


class Stopped(Exception):
    """The owner asked the round to stop."""


def _call(ray, hub, method: str, *args):
    return ray.get(hub.call.remote(method, *args)) if hub is not None else None


def start_name(adapter: str | None) -> str:
    """The start's name on the hub: `bare`, `hub:<id>`, or a hash of a local adapter's weights
    (never a local path: two machines must agree on the name)."""
    if not adapter:
        return "bare"
    if adapter.startswith("hub:"):
        return adapter
    weights = sorted(Path(adapter).glob("adapter_model.*"))
    digest = hashlib.sha256(weights[0].read_bytes() if weights else adapter.encode()).hexdigest()[
        :12
    ]
    return f"local:{digest}"


def hub_work(ray, hub, recipe: Recipe, with_slice: bool = True) -> Work | None:
    """The slice (plus validation turns) and the paper from the hub, or None if it cannot be had.
    Without the slice (a trial) only the paper is asked for: no turns are taken."""
    from gbray.data.turns import BadLines, parse_turn

    lines = _call(ray, hub, "slice", recipe.turns + recipe.val_turns) if with_slice else []
    paper = _call(ray, hub, "paper", recipe.exam_turns)
    if (with_slice and not lines) or not paper or not paper[0]:
        return None
    bad = BadLines()
    turns = [t for i, line in enumerate(lines) if (t := parse_turn(line, f"slice:{i}", bad))]
    exam = [t for i, line in enumerate(paper[0]) if (t := parse_turn(line, f"paper:{i}", bad))]
    val_count = min(recipe.val_turns, len(turns) // 5)
    log.info("hub: slice of %d turns, paper %s of %d turns", len(turns), paper[1], len(exam))
    return Work(
        turns[val_count:], turns[:val_count], exam, paper[1], paper[2], {"hub": bad.as_dict()}
    )


def wait_unless_stopped(ray, ref, hub, what: str):
    """The value of `ref`, unless the owner says stop first: then Stopped, within a few seconds
    (the caller kills the actor, so nothing more is computed)."""
    from gbray.examiner import ExamStopped

    while not ray.wait([ref], timeout=1.0)[0]:
        if hub is not None and ray.get(hub.stopped.remote()):
            raise Stopped(f"stopped by the owner during {what}")
    try:
        return ray.get(ref)
    except ExamStopped as e:
        raise Stopped(f"stopped by the owner during {what}") from e


def run_exam(
    ray,
    model: str,
    adapter: str | None,
    recipe: Recipe,
    paper: list[dict],
    log_path: Path,
    what: str,
    hub=None,
) -> dict:
    """One exam in a fresh examiner actor, killed when the exam is done or the owner says stop."""
    from gbray.actors import ExaminerActor

    gpus = 1 if recipe.device == "cuda" else 0
    actor = ExaminerActor.options(num_cpus=recipe.threads, num_gpus=gpus).remote(
        model, adapter, recipe.precision, recipe.threads, recipe.device, str(log_path), hub
    )
    try:
        ref = actor.exam.remote(paper, recipe.answer_budget, recipe.max_len, recipe.exam_batch)
        return wait_unless_stopped(ray, ref, hub, f"the {what} exam")
    finally:
        ray.kill(actor, no_restart=True)


def on_the_wire(exam: dict | None) -> dict | None:
    """An exam result as the hub protocol carries it: `agreement_pct` and `turns` first."""
    if not exam:
        return None
    keep = ("agreement_pct", "turns", "right", "no_tool", "minutes", "source", "by")
    return {k: exam[k] for k in keep if k in exam}


def new_round_id() -> str:
    return time.strftime("r-%Y%m%d-%H%M%S-") + os.urandom(2).hex()


def per_tool(baseline: dict | None, result: dict | None) -> dict:
    def cell(exam, tool):
        row = (exam or {}).get("per_tool", {}).get(tool)
        return f"{row['right']}/{row['asked']}" if row else None

    tools = (result or baseline or {}).get("per_tool", {})
    return {
        t: {"asked": row["asked"], "before": cell(baseline, t), "after": cell(result, t)}
        for t, row in tools.items()
    }


class Round:
    """One round's state and its steps; `run()` is the backbone, top to bottom."""

    def __init__(self, settings: RoundSettings):
        settings.validate()
        self.settings = settings
        # The student is found (or refused) before anything starts.
        model_dir, self.student_id = locate_model(settings.model)
        self.model = str(model_dir)
        self.started = time.time()
        self.out = Path(settings.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_path = self.out / "progress.log"
        self.record: dict = {"round": new_round_id(), "status": "starting"}
        self.ray = self.hub = None

    def write(self) -> None:
        (self.out / "round.json").write_text(json.dumps(self.record, indent=2, default=str))

    def note(self, line: str) -> None:
        log.info("%s", line)
        if self.hub is not None:
            self.hub.note.remote(line)

    def setup(self) -> None:
        s = self.settings
        # Bad data ends the round before anything starts: indexing reads raw lines only.
        self.local = index_folder(Path(s.data)) if s.data else None
        seed = s.recipe.resolve("cpu").seed
        self.ray = ray = _start_ray(s.address)
        device = _device(ray, s.recipe)
        self.recipe = dataclasses.replace(
            s.recipe.resolve(device), seed=seed, threads=_actor_cpus(ray, s.recipe)
        )
        (self.out / "recipe.json").write_text(json.dumps(as_record(self.recipe), indent=2))
        if s.hub:
            from gbray.actors import HubActor

            self.hub = HubActor.remote(
                {"url": s.hub, "token": s.token, "device": self.device_name()}
            )

    def device_name(self) -> str:
        import socket

        return self.settings.device_name or socket.gethostname()

    def get_work(self, with_slice: bool = True) -> Work:
        fetch = self.hub is not None and self.settings.fetch
        work = hub_work(self.ray, self.hub, self.recipe, with_slice) if fetch else None
        if work is None and fetch:
            log.warning(
                "hub: no slice or paper; %s",
                "using the local data folder" if self.local else "no fallback",
            )
        if work is None:
            if self.local is None:
                raise DataError(
                    "the hub could not be reached and there is no --data to fall back on"
                )
            if with_slice:
                work = local_work(Path(self.settings.data), *self.local, self.recipe)
            else:
                exam, paper_id = paper_of(self.local[1], self.recipe.exam_turns)
                scope = f"local:{Path(self.settings.data).resolve()}"
                work = Work([], [], exam, paper_id, scope, {})
        return work

    def register(self, work: Work, **extra) -> str | None:
        """The round on the hub, before any model is loaded: `base` is the student's model id;
        the start is named in the recipe."""
        recipe = {
            **as_record(self.recipe),
            "student": self.student_id,
            "start": start_name(self.settings.adapter),
            **extra,
        }
        return _call(self.ray, self.hub, "register", self.student_id, len(work.train), recipe)

    def start_adapter(self) -> str | None:
        adapter = self.settings.adapter
        if adapter and adapter.startswith("hub:"):
            try:
                return str(
                    _call(self.ray, self.hub, "get_adapter", adapter[4:], self.out / "start")
                )
            except Exception as e:  # noqa: BLE001 - Ray wraps the client's error; the reason is in it
                reason = str(e).strip().splitlines()[-1]
                raise DataError(f"could not fetch {adapter} from the hub: {reason}") from e
        return adapter

    def baseline_key(self, work: Work) -> dict:
        return {
            "scope": work.scope,
            "base": start_name(self.settings.adapter),
            "paper": work.paper_id,
            "turns": len(work.paper),
            "answer": self.recipe.answer_budget,
            "student": self.student_id,
        }

    def exam(self, adapter: str | None, work: Work, what: str) -> dict | None:
        self.note(
            f"{what} exam: {len(work.paper)} turns of paper {work.paper_id}, answer budget "
            f"{self.recipe.answer_budget}"
        )
        try:
            result = run_exam(
                self.ray,
                self.model,
                adapter,
                self.recipe,
                work.paper,
                self.log_path,
                what,
                self.hub,
            )
        except Stopped:
            raise
        except Exception as e:  # noqa: BLE001 - a crashed exam costs only that exam
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            log.error("%s exam failed: %s", what, reason)
            self.record[f"{what}_error"] = reason
            return None
        self.record.setdefault("exam_pids", []).append(result["pid"])
        self.note(
            f"{what}: {result['agreement_pct']:.1f}% agreement ({result['right']}/{result['turns']})"
        )
        return result

    def known_baseline(self, work: Work) -> tuple[dict | None, dict | None]:
        """(the baseline the hub knows, the hub's answer) for this round's key."""
        answer = _call(self.ray, self.hub, "ask_baseline", self.baseline_key(work))
        if answer and answer.get("known"):
            return {**answer["baseline"], "source": "hub", "by": answer.get("by")}, answer
        return None, answer

    def measure_baseline(self, work: Work, start: str | None) -> dict | None:
        # A freshly wrapped LoRA equals the bare start, so the baseline needs no trained model.
        baseline = self.exam(start, work, "baseline")
        if baseline is not None and self.hub is not None:
            _call(
                self.ray, self.hub, "tell_baseline", self.baseline_key(work), on_the_wire(baseline)
            )
        return baseline

    def baseline_first(self, work: Work, start: str | None) -> tuple[dict | None, bool]:
        """The baseline before training: (exam or known number, whether to read it at the end instead)."""
        if self.settings.skip_baseline:
            self.note("baseline skipped (--skip-baseline)")
            return None, False
        known, answer = self.known_baseline(work)
        if known:
            self.note(
                f"baseline known on the hub: {known['agreement_pct']:.1f}% (measured by {known['by']})"
            )
            return known, False
        if answer and not answer.get("measure"):
            self.note(f"baseline being measured by {answer.get('by')}; training at once")
            return None, True
        return self.measure_baseline(work, start), False

    def baseline_late(self, work: Work, start: str | None) -> dict | None:
        known, _ = self.known_baseline(work)
        if known:
            return known
        self.note("the baseline never arrived; measuring the start now")
        return self.measure_baseline(work, start)

    def train(self, work: Work, start: str | None) -> dict:
        from gbray.actors import TrainerActor

        ray, recipe = self.ray, self.recipe
        gpus = 1 if recipe.device == "cuda" else 0
        trainer = TrainerActor.options(num_cpus=recipe.threads, num_gpus=gpus).remote(
            self.model, start, as_record(recipe), str(self.out), str(self.log_path), self.hub
        )
        try:
            self.record["trainer_pid"] = ray.get(trainer.pid.remote())
            self.record["trainer_process"] = ray.get(trainer.process.remote())
            ref = trainer.train.remote(ray.put(work.train), work.val)
            summary = wait_unless_stopped(ray, ref, self.hub, "training")
        finally:
            # Free its CPUs (and memory) for the examiner; everything it made is on disk.
            ray.kill(trainer, no_restart=True)
        if summary["why"] == "stopped":
            raise Stopped("stopped by the owner during training")
        return summary

    def run(self) -> dict:
        self.setup()
        s, recipe, record = self.settings, self.recipe, self.record
        work = self.get_work(with_slice=not s.measure_only)
        hub_round = self.register(work, measure_only=s.measure_only)
        start = self.start_adapter()
        record.update(
            {
                "hub": s.hub,
                "hub_round": hub_round,
                "device": recipe.device,
                "device_name": self.device_name(),
                "student": self.model,
                "student_name": self.student_id,
                "carried_from": s.adapter,
                "start": start_name(s.adapter),
                "draw_seed": recipe.seed,
                "recipe": as_record(recipe),
                "measure_only": s.measure_only,
                "skip_baseline": s.skip_baseline,
                "paper": {"id": work.paper_id, "scope": work.scope, "turns": len(work.paper)},
                "slice_turns": len(work.train),
                "val_turns": len(work.val),
                "bad_lines": work.bad_lines,
                "driver": process_record(),
                "progress_log": str(self.log_path),
                "status": "running",
            }
        )
        self.write()
        baseline = result = None
        summary: dict = {}
        try:
            baseline, deferred = self.baseline_first(work, start)
            record["baseline"] = baseline
            self.write()
            if s.measure_only:
                record["why"] = "measure only: the start was examined, nothing trained"
                record["status"] = "done" if baseline is not None else "failed"
                return record
            summary = self.train(work, start)
            record.update(self.from_summary(summary))
            self.write()
            result = self.exam(summary["best"], work, "result")
            if deferred:
                baseline = self.baseline_late(work, start)
            record["status"] = "done" if result is not None else "failed"
        except Stopped as e:
            self.note(str(e))
            record["status"], record["why"] = "stopped", str(e)
        except Exception as e:
            record.update(status="failed", why=f"{type(e).__name__}: {e}")
            last = self.out / "last"
            record["adapter_last"] = str(last) if (last / "adapter_config.json").is_file() else None
            raise
        finally:
            record.update(
                baseline=baseline,
                result=result,
                minutes=round((time.time() - self.started) / 60, 2),
                beat=bool(
                    baseline and result and result["agreement_pct"] > baseline["agreement_pct"]
                ),
            )
            self.write()
            self.report_to_hub(work, summary)
        return record

    @staticmethod
    def from_summary(summary: dict) -> dict:
        keys = (
            "steps",
            "planned_steps",
            "replanned_from",
            "best_val_loss",
            "best_step",
            "checks",
            "turns_trained",
            "turn_passes",
            "epochs_done",
            "why",
            "mean_loss",
            "skipped_nan",
            "shortened",
        )
        return {
            **{k: summary[k] for k in keys},
            "training_minutes": summary["minutes"],
            "adapter": summary["best"],
            "adapter_last": summary["last"],
        }

    def why_sentence(self) -> str:
        record = self.record
        if record.get("status") == "done" and "steps" in record:
            return (
                f"training stopped ({record['why']}) after {record['steps']} steps and "
                f"{record['turns_trained']} turns; result examined on {record['paper']['turns']} turns"
            )
        return str(record.get("why") or record.get("result_error") or record.get("status"))

    def report_to_hub(self, work: Work, summary: dict) -> None:
        """Upload the adapter and end the round on the hub (both retried inside the client).
        A stopped round uploads nothing: a stop is a stop."""
        if self.hub is None or not self.record.get("hub_round"):
            return
        record = self.record
        adapter = record.get("adapter") if record["status"] != "stopped" else None
        name = self.ray.get(self.hub.put_adapter.remote(adapter)) if adapter else None
        ok = _call(
            self.ray,
            self.hub,
            "end",
            {
                "status": record["status"],
                "baseline": on_the_wire(record.get("baseline")),
                "result": on_the_wire(record.get("result")),
                "adapter": name,
                "paper": work.paper_id,
                "why": self.why_sentence(),
                "trained": summary.get("turns_trained", 0),
                "drawSeed": self.recipe.seed,
                "perTool": per_tool(record.get("baseline"), record.get("result")),
            },
        )
        record["hub_adapter"], record["hub_ended"] = name, bool(ok)
        self.write()


def run_round(settings: RoundSettings) -> dict:
    """Run one round; returns round.json's content (also written to settings.out/round.json)."""
    return Round(settings).run()


def run_trial(settings: RoundSettings) -> dict:
    """Score a candidate (the bare student or an adapter) on the paper: trains nothing, takes no
    turns. On the hub it is a round of its own (registered, notes, ended with its result and
    `trained: 0`), so the status page lists every candidate's score."""
    rnd = Round(settings)
    rnd.setup()
    work = rnd.get_work(with_slice=False)
    candidate = start_name(settings.adapter)
    hub_round = rnd.register(work, trial=True)
    status, why, result = "failed", f"trial of {candidate} failed", None
    try:
        result = rnd.exam(rnd.start_adapter(), work, "trial")
        if result is None:
            why = f"trial of {candidate} failed: {rnd.record.get('trial_error')}"
        else:
            status = "done"
            why = f"trial of {candidate}: {result['agreement_pct']:.1f}% on {result['turns']} turns"
    except Stopped as e:
        status, why = "stopped", str(e)
    except Exception as e:
        why = f"trial of {candidate} failed: {e}"
        raise
    finally:
        record = {
            "round": rnd.record["round"],
            "hub_round": hub_round,
            "status": status,
            "why": why,
            "candidate": candidate,
            "student": rnd.student_id,
            "paper": {"id": work.paper_id, "scope": work.scope, "turns": len(work.paper)},
            "result": result,
        }
        (rnd.out / "trial.json").write_text(json.dumps(record, indent=2))
        if hub_round:
            end = {
                "status": status,
                "baseline": None,
                "result": on_the_wire(result),
                "adapter": candidate,
                "paper": work.paper_id,
                "why": why,
                "trained": 0,
                "perTool": per_tool(None, result),
            }
            _call(rnd.ray, rnd.hub, "end", end)
    return record


def summary_line(record: dict, out: Path) -> dict:
    def agreement(key):
        exam = record.get(key)
        return exam["agreement_pct"] if exam else None

    return {
        "round_json": str(Path(out) / "round.json"),
        "baseline": agreement("baseline"),
        "result": agreement("result"),
        "beat": record.get("beat", False),
        "status": record.get("status"),
    }
