"""What the steps of a round return, as types: an exam's result and a training run's summary.
Torch-free, so the driver (and the hub) can hold them without loading torch."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class ExamResult:
    """One exam's outcome; `agreement_pct` and `turns` are what the hub protocol carries. A
    baseline the hub already knew has `source` "hub" and only the fields the hub keeps."""

    agreement_pct: float
    turns: int
    right: int | None = None
    no_tool: int | None = None
    per_tool: dict = field(default_factory=dict)
    minutes: float | None = None
    pid: int | None = None
    shortened: int | None = None
    samples: list = field(default_factory=list)
    threads: int | None = None
    source: str = "exam"
    by: str | None = None
    # One character per paper turn, "1" right, "0" wrong: what pairs this exam with another.
    marks: str | None = None
    near_ties: list = field(default_factory=list)
    generated_tokens: int | None = None
    prefix_tokens: int | None = None
    stop_at_tool: bool | None = None

    def on_the_wire(self, per_tool: bool = False) -> dict:
        """As the hub protocol carries an exam result: `agreement_pct` and `turns` first. A told
        baseline also carries its per-tool counts (`per_tool`, a field the old client neither
        sends nor reads), so a round that reads it can still judge each tool's fall."""
        wire = {"agreement_pct": self.agreement_pct, "turns": self.turns}
        for key in ("right", "no_tool", "minutes", "by", "marks"):
            if getattr(self, key) is not None:
                wire[key] = getattr(self, key)
        if self.near_ties:
            wire["near_ties"] = len(self.near_ties)
        if per_tool and self.per_tool:
            wire["per_tool"] = self.per_tool
        return {**wire, "source": self.source}

    @classmethod
    def from_hub(cls, exam: dict, by: str | None) -> ExamResult:
        """A baseline the hub knew, from what a device told it (untrusted: a field that does
        not add up is left out)."""
        keep = {
            k: exam[k]
            for k in ("right", "no_tool", "minutes")
            if isinstance(exam.get(k), int | float)
        }
        turns = int(exam.get("turns") or 0)
        marks = exam.get("marks")
        if isinstance(marks, str) and len(marks) == turns and set(marks) <= {"0", "1"}:
            keep["marks"] = marks
            rows = sane_per_tool(exam.get("per_tool"), turns, marks.count("1"))
            if rows:
                keep["per_tool"] = rows
        return cls(float(exam["agreement_pct"]), turns, **keep, source="hub", by=by)

    def with_tools_from_marks(self, tools: list[str]) -> ExamResult:
        """A known baseline without per-tool counts (told by the old client) given them from
        its marks and the paper's tools, turn by turn: right and asked, not what was answered
        instead (so the fallen-tool rule compares agreement, not F1, for it)."""
        if self.per_tool or self.marks is None or len(self.marks) != len(tools):
            return self
        rows: dict[str, dict] = {}
        for tool, mark in zip(tools, self.marks, strict=True):
            row = rows.setdefault(tool, {"asked": 0, "right": 0})
            row["asked"] += 1
            row["right"] += mark == "1"
        return replace(self, per_tool=rows)


def sane_per_tool(rows, turns: int, right: int) -> dict | None:
    """Per-tool counts as the examiner writes them ({tool: {asked, right, instead: {tool: n}}}),
    or None where they are not that or do not add up to the exam's turns and right answers."""

    def count(n) -> bool:
        return isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= turns

    if not isinstance(rows, dict) or not rows or len(rows) > turns:
        return None
    for tool, row in rows.items():
        if not (isinstance(tool, str) and isinstance(row, dict)):
            return None
        instead = row.get("instead", {})
        if not (count(row.get("asked")) and count(row.get("right")) and isinstance(instead, dict)):
            return None
        if row["right"] > row["asked"] or not all(
            isinstance(t, str) and count(n) for t, n in instead.items()
        ):
            return None
        if sum(instead.values()) != row["asked"] - row["right"]:
            return None
    if sum(r["asked"] for r in rows.values()) != turns:
        return None
    if sum(r["right"] for r in rows.values()) != right:
        return None
    return {t: {"asked": r["asked"], "right": r["right"], "instead": dict(r.get("instead", {}))}
            for t, r in rows.items()}  # fmt: skip


@dataclass
class TrainSummary:
    """What a training run returns; round.json is written from it."""

    steps: int
    planned_steps: int
    replanned_from: int | None
    turn_passes: int
    turns_trained: int
    epochs_done: float
    shortened: int
    skipped_nan: int
    mean_loss: float | None
    best_val_loss: float | None
    best_step: int | None
    checks: list
    why: str
    minutes: float
    final_lr: float
    best: str
    last: str
    threads: int
    turns_per_hour: float | None = None  # turn-passes an hour, measured after the first step
    resumed_from_step: int | None = None
    pid: int | None = None
    choices: dict | None = None  # autocast, checkpointing, threads, and why (tuning.Choices)
    averaged: int = 0  # times its adapter was averaged with other shares' while training
    sync_minutes: float = 0.0  # of `minutes`, spent in those syncs and in pooling gradients
    preparing_minutes: float = 0.0  # of `minutes`, spent fitting the slice before its first step
    # Other shares' turns whose gradients its steps took in (--pool-gradients).
    pooled_turns: int = 0
    # Optimizer steps that ran their turns' shared prompt prefix once, and the share of the
    # trained tokens that spared (gbray.prefix).
    shared_prefix_steps: int = 0
    spared_tokens_share: float | None = None
    # The kept check's agreement on the validation turns, how many there were, and the
    # schedule's kind and what began its cool-down (gbray.schedule).
    best_val_agreement: float | None = None
    val_turns: int = 0
    schedule: dict | None = None


class Stopped(Exception):
    """The owner asked the round to stop."""


class ExamStopped(Exception):
    """The owner asked the round to stop during this exam: there is no result (a partial exam is
    never one)."""
