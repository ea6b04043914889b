"""round.json and what the hub is told at a round's end, shaped from the steps' typed results.

`RoundRecord` is round.json's one schema: the round sets its fields as its steps end and writes
it whole each time; `as_json` is the file (its names are what users' scripts and the field's
tools read: `turn_passes`, `share_reports`, ...)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gbray.paired import FallRule, comparison
from gbray.results import ExamResult, TrainSummary

if TYPE_CHECKING:
    from gbray.shares import Trained

TRAINING_FIELDS = (
    "steps", "planned_steps", "replanned_from", "best_val_loss", "best_step", "checks",
    "turns_trained", "turn_passes", "epochs_done", "why", "mean_loss", "skipped_nan", "shortened",
    "turns_per_hour", "resumed_from_step", "choices", "averaged", "sync_minutes",
    "preparing_minutes", "pooled_turns", "shared_prefix_steps", "spared_tokens_share",
    "best_val_agreement", "val_turns", "schedule",
)  # fmt: skip


@dataclass
class RoundRecord:
    """What a round is and what each of its steps gave. A section is in round.json once its step
    has happened: no `exam_pids` before an exam, no training figures without training, no
    `merge` without a merge."""

    round: str
    status: str = "starting"  # running, done, stopped or failed
    why: str | None = None  # the round's own reason; a done round's is its training's
    # Where it runs and on what, set when it registers.
    hub: str | None = None
    hub_round: str | None = None
    device: str | None = None
    device_name: str | None = None
    student: str | None = None
    student_name: str | None = None
    carried_from: str | None = None  # the adapter setting as given
    start: str = "bare"
    serving: dict | None = None  # what the hub served, for a `hub:serving` start
    draw_seed: int | None = None
    recipe: dict | None = None
    measure_only: bool = False
    skip_baseline: bool = False
    shares: int = 1
    paper: dict | None = None
    slice_turns: int | None = None
    val_turns: int | None = None
    bad_lines: object = None
    driver: dict | None = None
    progress_log: str | None = None
    registered: bool = False
    # The steps.
    baseline: ExamResult | None = None
    result: ExamResult | None = None
    exam_errors: dict[str, str] = field(default_factory=dict)  # by exam: why it failed
    exam_pids: list[int] = field(default_factory=list)
    trainer_process: dict | None = None
    training: TrainSummary | None = None  # one trainer's
    trained: Trained | None = None  # shares'
    merge: dict | None = None
    adapter: str | None = None  # what the result exam took
    adapter_last: str | None = None  # a failed round's last checkpoint
    kept: dict | None = None  # what a stopped round had kept
    # The report.
    reported: bool = False
    beat: bool = False
    new_tools: dict | None = None
    comparison: dict | None = None
    minutes: float | None = None
    hub_adapter: str | None = None
    hub_ended: bool | None = None

    @property
    def turns_trained(self) -> int:
        if self.trained is not None:
            return self.trained.turns_trained
        return self.training.turns_trained if self.training else 0

    def error(self, what: str) -> str | None:
        return self.exam_errors.get(what)

    def as_json(self) -> dict:
        out: dict = {"round": self.round, "status": self.status}
        if self.registered:
            out.update(
                {
                    k: getattr(self, k)
                    for k in (
                        "hub",
                        "hub_round",
                        "device",
                        "device_name",
                        "student",
                        "student_name",
                        "carried_from",
                        "start",
                        "serving",
                        "draw_seed",
                        "recipe",
                        "measure_only",
                        "skip_baseline",
                        "shares",
                        "paper",
                        "slice_turns",
                        "val_turns",
                        "bad_lines",
                        "driver",
                        "progress_log",
                    )
                }  # fmt: skip
            )
        elif self.serving is not None:
            out["serving"] = self.serving
        out.update(baseline=exam_record(self.baseline), result=exam_record(self.result))
        out.update({f"{what}_error": why for what, why in self.exam_errors.items()})
        if self.exam_pids:
            out["exam_pids"] = self.exam_pids
        if self.trainer_process is not None:
            out["trainer_process"] = self.trainer_process
        if self.training is not None:
            out.update(training_record(self.training))
        if self.trained is not None:
            out.update(shares_record(self.trained))
        if self.merge is not None:
            out["merge"] = self.merge
        if self.adapter is not None:
            out["adapter"] = self.adapter
        if self.why is not None:
            out["why"] = self.why
        if self.kept is not None or self.status == "stopped":
            out["kept"] = self.kept
        if self.reported:
            out.update(
                beat=self.beat, new_tools=self.new_tools, comparison=self.comparison,
                minutes=self.minutes,
            )  # fmt: skip
            if self.status == "failed":
                out.setdefault("adapter_last", self.adapter_last)
        if self.hub_ended is not None:
            out.update(hub_adapter=self.hub_adapter, hub_ended=self.hub_ended)
        return out


def exam_record(exam: ExamResult | None) -> dict | None:
    return dataclasses.asdict(exam) if exam is not None else None


def training_record(summary: TrainSummary) -> dict:
    return {
        **{k: getattr(summary, k) for k in TRAINING_FIELDS},
        "training_minutes": summary.minutes,
        "adapter": summary.best,
        "adapter_last": summary.last,
        "trainer_pid": summary.pid,
    }


def shares_record(trained) -> dict:
    """Each share: where it ran, its measured speed, its part, what it trained or why it was lost."""
    return {
        "share_split": trained.split,
        "share_rounds": [s.hub_round for s in trained.shares if s.hub_round],
        "packed": trained.packed_note,
        "share_average_seconds": trained.average_every_seconds,
        "share_reports": [
            {
                "share": s.index,
                "node": s.node,
                "hub_round": s.hub_round,
                "probe_turns_per_hour": s.probe_turns_per_hour,
                "turns": s.turns,
                "training": training_record(s.summary) if s.summary else None,
                "exam": exam_record(s.exam),
                "lost": s.lost,
                "joined_minute": s.joined_minute,
                "left_minute": s.left_minute,
            }
            for s in trained.shares
        ],
        "joins": [
            {"share": s.index, "node": s.node, "minute": s.joined_minute, "turns": s.turns}
            for s in trained.shares
            if s.joined_minute is not None
        ],
        "lost_shares": [
            {"share": s.index, "node": s.node, "why": s.lost, "minute": s.left_minute}
            for s in trained.shares
            if s.lost
        ],
        "turns_trained": trained.turns_trained,
    }


def per_tool(baseline: ExamResult | None, result: ExamResult | None) -> dict:
    """Per tool: how often it was asked, right/asked before and after, and how often each exam
    answered it on any turn (which tells knowing a tool from answering it everywhere)."""

    def cell(exam, tool):
        row = exam.per_tool.get(tool) if exam else None
        return f"{row['right']}/{row['asked']}" if row else None

    def answered(exam, tool):
        rows = exam.per_tool.values() if exam else ()
        if not rows or not all("instead" in r for r in rows):
            return None  # counts rebuilt from marks say nothing of what was answered instead
        return exam.per_tool.get(tool, {}).get("right", 0) + sum(
            r["instead"].get(tool, 0) for r in rows
        )

    tools = (result or baseline).per_tool if (result or baseline) else {}
    return {
        t: {
            "asked": row["asked"],
            "before": cell(baseline, t),
            "after": cell(result, t),
            "answered_before": answered(baseline, t),
            "answered_after": answered(result, t),
        }
        for t, row in tools.items()
    }


def new_tools(
    baseline: ExamResult | None, result: ExamResult | None, slice_tools: set[str]
) -> dict | None:
    """Agreement on the paper's turns whose tool the slice never held, before and after (None
    when every tool on the paper was in the slice, or nothing was trained)."""
    exam = result or baseline
    if exam is None or not slice_tools:
        return None
    tools = sorted(t for t in exam.per_tool if t not in slice_tools)
    if not tools:
        return None
    asked = sum(exam.per_tool[t]["asked"] for t in tools)

    def right(e):
        return sum(e.per_tool.get(t, {}).get("right", 0) for t in tools) if e else None

    def pct(n):
        return round(100.0 * n / asked, 2) if n is not None else None

    before, after = right(baseline), right(result)
    return {"tools": tools, "asked": asked, "before": before, "after": after,
            "before_pct": pct(before), "after_pct": pct(after)}  # fmt: skip


def compare(
    baseline: ExamResult | None, result: ExamResult | None, rule: FallRule, new: list[str] = ()
) -> dict | None:
    """Before vs after on the same turns (None without both exams): paired counts and p-value,
    and per tool before and after with the tools that fell flagged."""
    if baseline is None or result is None:
        return None
    rows = per_tool(baseline, result)
    return {
        **comparison(baseline.marks, result.marks, rows, rule, new),
        "per_tool": rows,
    }


def beat(baseline: ExamResult | None, result: ExamResult | None) -> bool:
    return bool(baseline and result and result.agreement_pct > baseline.agreement_pct)


def why_sentence(record: dict) -> str:
    if record.get("status") == "done" and record.get("share_reports"):
        kept = [r for r in record["share_reports"] if not r["lost"]]
        lost = len(record["share_reports"]) - len(kept)
        return (
            f"{len(kept)} shares trained {record['turns_trained']} turns"
            + (f" ({lost} lost)" if lost else "")
            + (f", merged with {record['merge']['method']}" if record.get("merge") else "")
            + f"; result examined on {record['paper']['turns']} turns"
        )
    if record.get("status") == "done" and "steps" in record:
        return (
            f"training stopped ({record['why']}) after {record['steps']} steps and "
            f"{record['turns_trained']} turns; result examined on {record['paper']['turns']} turns"
        )
    return str(record.get("why") or record.get("result_error") or record.get("status"))


def end_body(record: dict, baseline, result, adapter: str | None, paper_id: str, seed) -> dict:
    """The round's end as the hub protocol carries it (SPEC §8); the paired comparison rides as
    an extra field (the hub recomputes it from the marks before it trusts it)."""
    compared = record.get("comparison") or {}
    return {
        "status": record["status"],
        "baseline": baseline.on_the_wire() if baseline else None,
        "result": result.on_the_wire() if result else None,
        "adapter": adapter,
        "paper": paper_id,
        "why": why_sentence(record),
        "trained": record.get("turns_trained", 0) or 0,
        "drawSeed": seed,
        "perTool": per_tool(baseline, result),
        "paired": compared.get("paired"),
        "fell": compared.get("fell"),
        "newTools": record.get("new_tools"),
    }


def _plain(value):
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else str(value)


def write(out: Path, record: dict, name: str = "round.json") -> None:
    (Path(out) / name).write_text(json.dumps(record, indent=2, default=_plain))


def summary_line(record: dict, out: Path) -> dict:
    def agreement(key):
        exam = record.get(key)
        return exam["agreement_pct"] if exam else None

    return {
        "round_json": str(Path(out) / "round.json"),
        "baseline": agreement("baseline"),
        "result": agreement("result"),
        "beat": record.get("beat", False),
        "p_value": ((record.get("comparison") or {}).get("paired") or {}).get("p_value"),
        "status": record.get("status"),
    }


# What a round writes in its OUT folder; anything else there is left where it is.
ROUND_ENTRIES = ("round.json", "recipe.json", "progress.log", "best", "last", "start", "merged")
ROUND_PATTERNS = ("share-*", "merge-input-*")


@dataclass
class MovedAside:
    """Where an earlier round's files in OUT went (`aside`, None where there were none) and
    which entries of OUT they were."""

    out: Path
    aside: Path | None = None
    names: tuple[str, ...] = ()

    def relocate(self, adapter: str | None) -> str | None:
        """`adapter` as it is found now: a folder of the earlier round (carrying on from last
        night's OUT/best in the same OUT) is where it was moved to."""
        if not adapter or adapter.startswith(("hub:", "merge:")) or self.aside is None:
            return adapter
        try:
            inside = Path(adapter).resolve().relative_to(self.out.resolve())
        except ValueError:
            return adapter
        return (
            str(self.aside / inside)
            if inside.parts[:1] and inside.parts[0] in self.names
            else adapter
        )


def keep_earlier_round(out: Path) -> MovedAside:
    """Move an earlier round's files in `out` into out/earlier/<its round id>, so that a round
    given last night's --out loses nothing (it would write its adapters and round.json over
    that night's)."""
    found = [out / name for name in ROUND_ENTRIES if (out / name).exists()]
    found += sorted(p for pattern in ROUND_PATTERNS for p in out.glob(pattern))
    if not found:
        return MovedAside(out)
    try:
        name = str(json.loads((out / "round.json").read_text())["round"])
    except (OSError, ValueError, KeyError, TypeError):  # a round that ended before writing it
        name = "unfinished"
    aside = out / "earlier" / name
    n = 1
    while aside.exists():
        n += 1
        aside = out / "earlier" / f"{name}-{n}"
    aside.mkdir(parents=True)
    for path in found:
        path.rename(aside / path.name)
    return MovedAside(out, aside, tuple(path.name for path in found))
