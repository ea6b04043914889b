"""One round's backbone (SPEC §4): work, baseline, train (one share or N), merge, exam, report.
Then stop; promotion is not the round's business.

The driver stays light: it loads no model (torch comes in only with the student's tokenizer,
where the paper's tokens are counted to size the student's own window). Where training, exams
and the merge run is the round's `Cluster` (gbray.ray_cluster on Ray: trainers in their own
actors, every exam in a fresh examiner actor killed when its exam is done, so an exam never
shares a process or an allocator with training; gbray.local_cluster: all in this process).
Shares are `shares`; the work is `work`; the record is `record`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path

from gbray import record as rec
from gbray.cluster import Cluster, Exam
from gbray.data.fit import window_for
from gbray.data.turns import DataError, index_folder
from gbray.hub.client import Hub, NoHub
from gbray.paired import Paired, fallen_name
from gbray.platform import process_record
from gbray.ray_cluster import RayCluster
from gbray.results import ExamResult, Stopped
from gbray.settings import (
    RoundSettings,
    TrainerJob,
    as_record,
    average_every_seconds,
    chosen_because,
    locate_model,
    merge_members,
    prompt_lengths,
    student_choice,
    student_context,
)
from gbray.shares import Share, ShareNight, Trained, stale_syncs
from gbray.work import Work, get_work

log = logging.getLogger(__name__)


def start_name(adapter: str | None) -> str:
    """The start's name on the hub: `bare`, `hub:<id>`, or a hash of a local adapter's weights
    (never a local path: two machines must agree on the name)."""
    if not adapter:
        return "bare"
    if adapter.startswith("hub:"):
        return adapter
    weights = sorted(Path(adapter).glob("adapter_model.*"))
    data = weights[0].read_bytes() if weights else adapter.encode()
    return f"local:{hashlib.sha256(data).hexdigest()[:12]}"


SERVING = "hub:serving"


def serving_start(hub: Hub) -> tuple[str | None, dict | None]:
    """`hub:serving` resolved when the round starts: the adapter that serves (`hub:NAME`) and what
    the hub says of it (its round, since when, that round's scores), or the bare student while
    nothing serves. A hub that cannot say stops the round: its start would be unknown."""
    try:
        serving = hub.serving()
    except Exception as e:  # noqa: BLE001 - Ray wraps the client's error; the reason is in it
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise DataError(f"could not ask the hub what serves: {reason}") from e
    if not serving:
        return None, None
    return f"hub:{serving['adapter']}", serving


def new_round_id() -> str:
    return time.strftime("r-%Y%m%d-%H%M%S-") + os.urandom(2).hex()


@dataclasses.dataclass
class Baseline:
    """The start's score: known now, being measured beside training, or to be read at the end."""

    known: ExamResult | None = None
    running: Exam | None = None
    deferred: bool = False


class Round:
    """One round's state and its steps; `run()` is the backbone, top to bottom."""

    def __init__(self, settings: RoundSettings, cluster: Cluster | None = None):
        settings.validate()
        self.settings = settings
        self.given_cluster = cluster  # None: Ray's (a local Ray, or the one at --address)
        # The student is found (or refused) before anything starts.
        model_dir, self.student_id = locate_model(settings.model)
        self.model = str(model_dir)
        self.started = time.time()
        self.out = Path(settings.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_path = self.out / "progress.log"
        self.record = rec.RoundRecord(new_round_id())
        # `merge:A,B,...` (the field's syntax): join those adapters, train nothing, examine once.
        self.merge_inputs = merge_members(settings.adapter)
        self.adapter = settings.adapter  # hub:serving becomes hub:NAME once the hub is asked
        self.start = "bare" if self.merge_inputs else start_name(settings.adapter)

    def run(self) -> dict:
        moved = rec.keep_earlier_round(self.out)
        self.adapter = moved.relocate(self.adapter)
        self.merge_inputs = [moved.relocate(a) for a in self.merge_inputs]
        self.setup()
        if moved.aside:
            self.note(f"an earlier round's files in {self.out} were moved to {moved.aside}")
        work = self.work()
        self.size_window(work)
        self.register(work)
        adapter = None
        try:
            start = self.start_adapter()
            baseline = self.baseline(work, start)
            self.record.baseline = baseline.known
            if not self.settings.measure_only:
                trained = self.train(work, start)
                adapter = self.merge(trained)
                self.record.result = self.exam(adapter, work, "result")
                self.examine_shares(trained, work)
            self.settle(baseline, work, start)
        except Stopped as e:
            self.note(str(e))
            self.record.status, self.record.why = "stopped", str(e)
            self.record.kept = self.kept_so_far()
        except Exception as e:
            self.record.status, self.record.why = "failed", f"{type(e).__name__}: {e}"
            raise
        finally:
            self.report(work, adapter)
        return self.record.as_json()

    # -- setup ----------------------------------------------------------------------------------

    def setup(self) -> None:
        s = self.settings
        # Bad data ends the round before anything starts: indexing reads raw lines only.
        self.local = index_folder(Path(s.data)) if s.data else None
        self.cluster = self.given_cluster or RayCluster(s.address)
        self.recipe = self.cluster.resolve(s.recipe)
        if s.shares > 1 and s.recipe.turns is None:
            # Each share takes what one machine would: the slice grows with the machines.
            self.recipe = dataclasses.replace(self.recipe, turns=self.recipe.turns * s.shares)
        corpus = len(self.local[0]) if self.local else None
        chosen = student_choice(self.model, s.recipe.hours, corpus)
        self.recipe_why = chosen_because(chosen, self.recipe)
        self.write_recipe()
        self.hub = self.new_hub()
        if self.adapter == SERVING:
            self.adapter, self.record.serving = serving_start(self.hub)
            self.start = start_name(self.adapter)
            log.info("hub:serving is %s", self.start)

    def size_window(self, work: Work) -> None:
        """The student's own max_len (one given is kept) raised to what nine in ten of the
        paper's turns need unshortened, prompt and answer budget, within the student's context.
        A window below the data's turns shortens every turn, in training and in the exam, and
        cuts the history and catalogue the answer depends on. Sized by the paper, which is
        fixed, so every round on one paper sits the same exam."""
        r = self.recipe
        if "max_len" not in self.settings.student_chose or not work.paper:
            return
        room = max(r.answer_budget, r.answer_room)
        needs = [n + room for n in prompt_lengths(self.model, work.paper)]
        context = student_context(self.model)
        window = window_for(needs, r.max_len, context)
        if window == r.max_len:
            return
        over = sum(n > r.max_len for n in needs)
        self.recipe_why["max_len"] = (
            f"raised from the student's {r.max_len}: {over} of the paper's {len(needs)} turns "
            f"need more (the prompt and a {room}-token answer); {window} fits nine in ten, "
            f"within the student's {context} positions"
        )
        self.recipe = dataclasses.replace(r, max_len=window)
        log.info("max_len %d: %s", window, self.recipe_why["max_len"])
        self.write_recipe()

    def new_hub(self) -> Hub:
        """A hub client for one round on the hub (the round's, or a share's)."""
        s = self.settings
        if not s.hub:
            return NoHub()
        ca = str(s.ca) if s.ca else None
        return self.cluster.hub(
            {"url": s.hub, "token": s.token, "device": self.device_name(), "ca": ca}
        )

    def device_name(self) -> str:
        import socket

        return self.settings.device_name or socket.gethostname()

    def note(self, line: str) -> None:
        log.info("%s", line)
        self.hub.note(line)

    def write(self) -> None:
        rec.write(self.out, self.record.as_json())

    # -- steps ----------------------------------------------------------------------------------

    def work(self) -> Work:
        s = self.settings
        return get_work(
            self.hub,
            self.local,
            s.data,
            self.recipe,
            with_slice=not (s.measure_only or self.merge_inputs),
            fetch=s.fetch,
        )

    def hub_recipe(self, **extra) -> dict:
        return {**as_record(self.recipe), "student": self.student_id, "start": self.start, **extra}

    def register(self, work: Work) -> None:
        """The round on the hub, before any model is loaded, and round.json's first version."""
        s, recipe = self.settings, self.recipe
        extra = {"measure_only": True} if s.measure_only else {}
        if s.shares > 1:
            extra["merge_of"] = s.shares
        hub_round = self.hub.register(self.student_id, len(work.train), self.hub_recipe(**extra))
        self.record = dataclasses.replace(
            self.record,
            status="running",
            registered=True,
            hub=s.hub,
            hub_round=hub_round,
            device=recipe.device,
            device_name=self.device_name(),
            student=self.model,
            student_name=self.student_id,
            carried_from=s.adapter,
            start=self.start,
            draw_seed=recipe.seed,
            recipe=as_record(recipe),
            measure_only=s.measure_only,
            skip_baseline=s.skip_baseline,
            shares=s.shares,
            paper=work.paper_record,
            slice_turns=len(work.train),
            val_turns=len(work.val),
            bad_lines=work.bad_lines,
            driver=process_record(),
            progress_log=str(self.log_path),
        )
        self.write()

    def fetch(self, adapter: str, into: Path) -> str:
        """An adapter's folder: a local one as it is, hub:NAME fetched from the hub."""
        if not adapter.startswith("hub:"):
            return adapter
        try:
            return str(self.hub.get_adapter(adapter[4:], into))
        except Exception as e:  # noqa: BLE001 - Ray wraps the client's error; the reason is in it
            reason = str(e).strip().splitlines()[-1]
            raise DataError(f"could not fetch {adapter} from the hub: {reason}") from e

    def start_adapter(self) -> str | None:
        """The start's folder. For `merge:...` the start is the one the shares trained from
        (the bare student when their adapters do not say)."""
        if self.merge_inputs:
            self.merge_folders = [
                self.fetch(a, self.out / f"merge-input-{i}")
                for i, a in enumerate(self.merge_inputs)
            ]
            starts = {self.start_recorded(f) for f in self.merge_folders}
            self.start = starts.pop() if len(starts) == 1 and None not in starts else "bare"
            self.record.start = self.start
            return None if self.start == "bare" else self.fetch(self.start, self.out / "start")
        return self.fetch(self.adapter, self.out / "start") if self.adapter else None

    def kept_so_far(self) -> dict | None:
        """The adapter a stopped night had kept (OUT/best, written at its best validation):
        a stop uploads and examines nothing, but what training had made stays on disk."""
        best = self.out / "best"
        try:
            state = json.loads((best / "trainer_state.json").read_text())
        except (OSError, ValueError):
            return None
        return {
            "adapter": str(best),
            "step": state.get("step"),
            "val_agreement": state.get("best_val_agreement"),
            "val_loss": state.get("best_val_loss"),
        }

    @staticmethod
    def start_recorded(folder: str) -> str | None:
        try:
            return json.loads((Path(folder) / "trainer_state.json").read_text()).get("start")
        except (OSError, ValueError):
            return None

    def baseline_key(self, work: Work) -> dict:
        return {
            "scope": work.scope,
            "base": self.start,
            "paper": work.paper_id,
            "turns": len(work.paper),
            "answer": self.recipe.answer_budget,
            "student": self.student_id,
        }

    def known_baseline(self, work: Work) -> tuple[ExamResult | None, dict | None]:
        answer = self.hub.ask_baseline(self.baseline_key(work))
        if answer and answer.get("known"):
            known = ExamResult.from_hub(answer["baseline"], answer.get("by"))
            return known.with_tools_from_marks([t["tool"] for t in work.paper]), answer
        return None, answer

    def baseline(self, work: Work, start: str | None) -> Baseline:
        """The start's score before training (`baseline_plan` says how it is had)."""
        s = self.settings
        known, answer = (None, None) if s.skip_baseline else self.known_baseline(work)
        plan = baseline_plan(s.skip_baseline, known is not None, answer, s.shares,
                             self.room_beside_shares)  # fmt: skip
        if plan == "skipped":
            self.note("baseline skipped (--skip-baseline)")
            return Baseline()
        if plan == "known":
            self.note(
                f"baseline known on the hub: {known.agreement_pct:.1f}% (measured by {known.by})"
            )
            return Baseline(known=known)
        if plan == "deferred":
            self.note(f"baseline being measured by {answer.get('by')}; training at once")
            return Baseline(deferred=True)
        if plan == "beside":
            self.note("baseline exam beside the shares (the cluster has room)")
            return Baseline(running=self.launch_exam(start, work, "baseline"))
        return Baseline(known=self.measure(start, work))

    def room_beside_shares(self) -> bool:
        return self.cluster.room_for(self.settings.shares + 1, self.recipe.threads)

    def launch_exam(self, adapter: str | None, work: Work, what: str) -> Exam:
        self.note(
            f"{what} exam: {len(work.paper)} turns of paper {work.paper_id}, answer budget "
            f"{self.recipe.answer_budget}"
        )
        return self.cluster.exam(
            self.model, adapter, self.recipe, work.paper, self.log_path, self.hub
        )

    def finish_exam(self, launch: Exam, what: str) -> ExamResult | None:
        try:
            result = launch.result(self.hub, what)
        except Stopped:
            raise
        except Exception as e:  # noqa: BLE001 - a crashed exam costs only that exam
            reason = " · ".join(x.strip() for x in str(e).strip().splitlines() if x.strip())
            reason = reason[:600] or type(e).__name__
            log.error("%s exam failed: %s", what, reason)
            self.record.exam_errors[what] = reason
            return None
        self.record.exam_pids.append(result.pid)
        self.note(f"{what}: {result.agreement_pct:.1f}% agreement ({result.right}/{result.turns})")
        return result

    def exam(self, adapter: str | None, work: Work, what: str) -> ExamResult | None:
        return self.finish_exam(self.launch_exam(adapter, work, what), what)

    def measure(
        self, start: str | None, work: Work, launch: Exam | None = None
    ) -> ExamResult | None:
        # A freshly wrapped LoRA equals the bare start, so the baseline needs no trained model.
        baseline = self.finish_exam(launch or self.launch_exam(start, work, "baseline"), "baseline")
        if baseline is not None:
            self.hub.tell_baseline(self.baseline_key(work), baseline.on_the_wire(per_tool=True))
        return baseline

    def train(self, work: Work, start: str | None) -> Trained:
        if self.merge_inputs:
            shares = [Share(i, adapter=f, weight=1.0) for i, f in enumerate(self.merge_folders)]
            self.note(
                f"merging {len(shares)} adapters (fedavg, as the field does); nothing trained"
            )
            return Trained(shares)
        if self.settings.shares > 1:
            return self.train_shares(work, start)
        summary, self.record.trainer_process = self.cluster.train(
            self.job(start), work.train, work.val, self.hub
        )
        if summary.why == "stopped":
            raise Stopped("stopped by the owner during training")
        self.record.training = summary
        self.write()
        self.record_choices([summary.choices])
        share = Share(0, turns=len(work.train), out=str(self.out))
        share.trained(summary)
        return Trained([share])

    def train_shares(self, work: Work, start: str | None) -> Trained:
        s = self.settings
        night = ShareNight(
            job=self.job(start),
            new_hub=self.new_hub,
            hub_recipe=self.hub_recipe(share_of=self.record.hub_round),
            student_id=self.student_id,
            grace_seconds=s.share_grace,
            average_every_seconds=average_every_seconds(s),
            outer_lr=s.outer_lr,
            outer_momentum=s.outer_momentum,
            pool_gradients=s.pool_gradients,
            step_together=s.step_together,
            joins=s.share_joins,
            options=list(s.share_options),
        )
        trained = self.cluster.train_shares(
            night, s.shares, work.train, work.val, self.hub, self.note
        )
        self.record.trained = trained
        self.write()
        self.record_choices([x.summary.choices if x.summary else None for x in trained.shares])
        check_survivors(trained)
        return trained

    def job(self, start: str | None) -> TrainerJob:
        return TrainerJob(self.model, start, self.start, self.recipe, self.out, self.record.round)

    def record_choices(self, choices: list[dict | None]) -> None:
        """What each trainer chose on its machine (precision, checkpointing, threads, and why),
        written into recipe.json beside the recipe, so two rounds stay comparable."""
        self.write_recipe(trainer_choices=choices)

    def write_recipe(self, **extra) -> None:
        """recipe.json: the resolved recipe, why the student chose the values it chose, and
        what is known so far of each trainer's own choices."""
        recipe = {**as_record(self.recipe), "why": self.recipe_why, **extra}
        (self.out / "recipe.json").write_text(json.dumps(recipe, indent=2))

    def merge(self, trained: Trained) -> str:
        """The adapter the result exam takes (`merge_plan`): the averager's global adapter, the
        one survivor's, or the survivors' merged (a Ray task over the merge module, weighted by
        the turns each trained)."""
        survivors = trained.survivors
        plan = merge_plan(trained, bool(self.merge_inputs), self.settings.merge_method)
        if plan == "outer":
            # The shares synced while they trained: the averager's global adapter is the merge
            # (with what a lost share synced before it went).
            m = trained.merged
            self.note(
                f"merged {len(survivors)} shares: the averager's global adapter after "
                f"{len(m['syncs'])} syncs (outer lr {m['outer_lr']}, momentum {m['outer_momentum']}"
                f"{'; every step its gradients pooled' if m.get('pool_gradients') else ''}"
                f"{'; equal shares stepping together' if m.get('step_together') else ''})"
                f"{stale_syncs(m['syncs'])}"
            )
            self.record.merge, self.record.adapter = {"method": "outer", **m}, m["folder"]
            self.write()
            return m["folder"]
        if plan == "one":
            self.record.adapter = survivors[0].adapter
            return survivors[0].adapter
        out = self.out / "merged"
        report = self.cluster.merge(
            [s.adapter for s in survivors], out, plan, [s.weight for s in survivors]
        )
        self.note(
            f"merged {len(survivors)} shares ({report['method']}, rank {report['rank']}, "
            f"weights {report['weights']}, residual {report['residual_max']:.2e})"
        )
        self.record.merge, self.record.adapter = report, str(out)
        self.write()
        return str(out)

    def examine_shares(self, trained: Trained, work: Work) -> None:
        """Each share's own adapter on the same paper, when asked (to compare with the merge)."""
        if not (self.settings.examine_shares and len(trained.survivors) > 1):
            return
        for share in trained.survivors:
            share.exam = self.exam(share.adapter, work, f"share {share.index}")

    def settle(self, baseline: Baseline, work: Work, start: str | None) -> None:
        """The baseline's number, however it was had, and the round's status."""
        known = baseline.known
        if baseline.running is not None:
            known = self.measure(start, work, baseline.running)
        if baseline.deferred:
            known, _ = self.known_baseline(work)
            if known is None:
                self.note("the baseline never arrived; measuring the start now")
                known = self.measure(start, work)
        r = self.record
        r.baseline = known
        wanted = "baseline" if self.settings.measure_only else "result"
        r.status = "done" if getattr(r, wanted) is not None else "failed"
        if r.status == "failed":
            r.why = r.why or f"the {wanted} exam failed: {r.error(wanted) or 'it did not finish'}"
        if self.settings.measure_only:
            r.why = "measure only: the start was examined, nothing trained"

    def report(self, work: Work, adapter: str | None) -> None:
        """round.json, then the adapter and the end on the hub (both retried inside the client).
        A stopped round uploads nothing: a stop is a stop."""
        r = self.record
        baseline, result = r.baseline, r.result
        new = rec.new_tools(baseline, result, {t["tool"] for t in work.train + work.val})
        r.reported, r.beat, r.new_tools = True, rec.beat(baseline, result), new
        r.comparison = rec.compare(
            baseline, result, self.settings.fall_rule(), new["tools"] if new else ()
        )
        r.minutes = round((time.time() - self.started) / 60, 2)
        self.note_comparison(r.comparison)
        if new:
            self.note(
                f"new tools (never in the slice: {', '.join(new['tools'])}), {new['asked']} turns: "
                f"{new['before_pct']}% before, {new['after_pct']}% after"
            )
        if r.status == "failed":
            last = self.out / "last"
            r.adapter_last = str(last) if (last / "adapter_config.json").is_file() else None
        self.write()
        if not r.hub_round:
            return
        uploaded = (
            self.hub.put_adapter(Path(adapter)) if adapter and r.status != "stopped" else None
        )
        body = rec.end_body(
            r.as_json(), baseline, result, uploaded, work.paper_id, self.recipe.seed
        )
        share_rounds = [x.hub_round for x in r.trained.shares if x.hub_round] if r.trained else []
        if share_rounds:
            body["shares"] = share_rounds
        r.hub_adapter, r.hub_ended = uploaded, bool(self.hub.end(body))
        if uploaded and result is not None:
            # A score belongs to the adapter (SPEC §12): a night started from this one on this
            # paper reads its baseline instead of sitting the same exam again.
            start = {**self.baseline_key(work), "base": f"hub:{uploaded}"}
            self.hub.tell_baseline(start, result.on_the_wire(per_tool=True))
        self.write()

    def note_comparison(self, compared: dict | None) -> None:
        if not compared:
            return
        if compared["paired"]:
            paired = Paired(**compared["paired"])
            self.note(f"paired on {paired.turns} turns: {paired.sentence()}")
        for fell in compared["fell"]:
            self.note(f"tool {fallen_name(fell)} fell: {fell['before']} -> {fell['after']}")


def baseline_plan(skip: bool, known: bool, answer: dict | None, shares: int,
                  room_beside_shares) -> str:  # fmt: skip
    """How the start's score is had: `skipped` (asked), `known` (on the hub), `deferred` (another
    device is measuring it: read it at the end), `beside` (measured while the shares train, where
    the cluster has room), or `now` (measured before training)."""
    if skip:
        return "skipped"
    if known:
        return "known"
    if answer and not answer.get("measure"):
        return "deferred"
    if shares > 1 and room_beside_shares():
        return "beside"
    return "now"


def merge_plan(trained: Trained, merging_inputs: bool, method: str) -> str:
    """What the result exam takes: `outer` (the shares synced: the averager's global adapter,
    with what a lost share synced), `one` (a single survivor), or the merge method that joins
    the survivors (`fedavg` for the field's `merge:` syntax)."""
    if trained.merged:
        return "outer"
    if len(trained.survivors) == 1:
        return "one"
    return "fedavg" if merging_inputs else method


def check_survivors(trained: Trained) -> None:
    """A night whose every share was lost has nothing to examine: it fails, naming why."""
    if not trained.survivors:
        raise RuntimeError(
            "no share survived: " + "; ".join(f"share {x.index}: {x.lost}" for x in trained.shares)
        )


def run_round(settings: RoundSettings, cluster: Cluster | None = None) -> dict:
    """Run one round; returns round.json's content (also written to settings.out/round.json).
    `cluster`: where it runs (default: Ray's)."""
    return Round(settings, cluster).run()


def run_trial(settings: RoundSettings, cluster: Cluster | None = None) -> dict:
    """Score a candidate (the bare student or an adapter) on the paper: trains nothing, takes no
    turns. On the hub it is a round of its own (registered, notes, ended with its result and
    `trained: 0`), so the status page lists every candidate's score."""
    rnd = Round(settings, cluster)
    rnd.setup()
    work = get_work(
        rnd.hub, rnd.local, settings.data, rnd.recipe, with_slice=False, fetch=settings.fetch
    )
    rnd.size_window(work)
    hub_round = rnd.hub.register(rnd.student_id, 0, rnd.hub_recipe(trial=True))
    status, why, result = "failed", f"trial of {rnd.start} failed", None
    try:
        result = rnd.exam(rnd.start_adapter(), work, "trial")
        if result is None:
            why = f"trial of {rnd.start} failed: {rnd.record.error('trial')}"
        else:
            status = "done"
            why = f"trial of {rnd.start}: {result.agreement_pct:.1f}% on {result.turns} turns"
    except Stopped as e:
        status, why = "stopped", str(e)
    except Exception as e:
        why = f"trial of {rnd.start} failed: {e}"
        raise
    finally:
        record = {
            "round": rnd.record.round,
            "hub_round": hub_round,
            "status": status,
            "why": why,
            "candidate": rnd.start,
            "serving": rnd.record.serving,
            "student": rnd.student_id,
            "paper": work.paper_record,
            "result": rec.exam_record(result),
        }
        rec.write(rnd.out, record, "trial.json")
        if hub_round:
            rnd.hub.end(
                {
                    "status": status,
                    "baseline": None,
                    "result": result.on_the_wire() if result else None,
                    "adapter": rnd.start,
                    "paper": work.paper_id,
                    "why": why,
                    "trained": 0,
                    "perTool": rec.per_tool(None, result),
                }
            )
    return record


summary_line = rec.summary_line
