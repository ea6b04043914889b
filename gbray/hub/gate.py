"""The promotion gate: which ended round may serve, and, when it may not, the rule that says no.

A round is promoted only if it ended done, beat its own baseline on its paper, and scores above
what serves now on that same paper (a round is held to what serves, not only to where it
started). The owner may further require the win to be significant (exact McNemar p below a
level, from the per-turn marks both exams carry) and no tool to have fallen by more than a set
amount. The paired counts are recomputed here from the marks; the device's own p is not trusted.
"""

from __future__ import annotations

from dataclasses import dataclass

from gbray.paired import FallRule, fallen_name, fallen_tools, grouped, pair
from gbray.settings import setting


@dataclass(frozen=True)
class GateRules:
    """What a round must also show to be promoted, beyond beating its baseline and what serves."""

    promote_p: float | None = setting(
        None,
        "also require significance: the exact McNemar p-value of the round against its "
        "baseline, from the per-turn marks, below this (e.g. 0.05)",
    )
    refuse_fallen: bool = setting(
        False, "also refuse a round with a tool that fell by more than --fall-points"
    )
    fall_points: float = setting(
        20.0, "percentage points a tool's agreement may fall before it is flagged"
    )
    fall_min_asked: int = setting(5, "only tools asked at least this often on the paper count")
    fall_min_turns: int = setting(
        5, "and only a tool that lost at least this many of its turns (net) has fallen"
    )

    def validate(self) -> None:
        if self.promote_p is not None and not 0 < self.promote_p <= 1:
            raise ValueError("--promote-p must be in (0, 1]")
        if not 0 <= self.fall_points <= 100 or self.fall_min_asked < 1 or self.fall_min_turns < 1:
            raise ValueError(
                "--fall-points must be in [0, 100], --fall-min-asked and --fall-min-turns >= 1"
            )

    def fall_rule(self) -> FallRule:
        return FallRule(self.fall_points, self.fall_min_asked, self.fall_min_turns)


# What `--auto-promote` holds a round to beyond the plain gate unless told otherwise: nobody looks
# at a promotion made at night, so it must be significant and trade no tool away.
UNATTENDED = {"promote_p": 0.05, "refuse_fallen": True}


@dataclass(frozen=True)
class Candidate:
    """The round asked to serve, as the hub stored its end."""

    round: str
    status: str
    ended: bool
    paper: str | None
    baseline: float | None
    result: float | None
    end_body: dict


@dataclass(frozen=True)
class Serving:
    """What serves now and its score on the candidate's paper (None: never measured there)."""

    round: str
    score: float | None
    measured_by: str | None  # how the score is known: which round measured it, and how


def refusal(c: Candidate, serving: Serving | None, rules: GateRules) -> str | None:
    """Why the candidate may not serve, naming every rule it broke ("; " between them, in the
    order below); None when every rule holds. A round that has not ended done, or reported no
    baseline and result on one paper, is refused for that alone: the other rules need both."""
    if not c.ended or c.status != "done":
        return f"round {c.round} has not ended done (status {c.status})"
    if c.baseline is None or c.result is None or not c.paper:
        return f"round {c.round} reported no baseline and result on one paper"
    broken = [
        why
        for why in (
            _beat_baseline(c),
            _above_serving(c, serving),
            _significance(c, rules),
            _no_fallen_tool(c, rules),
        )
        if why
    ]
    return "; ".join(broken) or None


def _beat_baseline(c: Candidate) -> str | None:
    if c.result > c.baseline:
        return None
    return (
        f"beat its baseline: round {c.round} did not beat its baseline on paper {c.paper}: "
        f"{c.result:.1f} vs {c.baseline:.1f}"
    )


def _above_serving(c: Candidate, serving: Serving | None) -> str | None:
    if serving is None or serving.round == c.round:
        return None
    if serving.score is None:
        return (
            f"above what serves: what serves (round {serving.round}) has no score on paper "
            f"{c.paper}; measure it there first (gbray trial --adapter hub:{serving.round})"
        )
    if c.result > serving.score:
        return None
    return (
        f"above what serves: round {c.round} scored {c.result:.1f} on paper {c.paper}, "
        f"not above what serves (round {serving.round}: {serving.score:.1f}, "
        f"{serving.measured_by})"
    )


def _significance(c: Candidate, rules: GateRules) -> str | None:
    if rules.promote_p is None:
        return None
    body = c.end_body or {}
    paired = pair(_marks(body.get("baseline")), _marks(body.get("result")))
    if paired is None:
        return (
            f"significance: round {c.round} carries no per-turn marks for both its baseline "
            f"and its result, so its p-value is unknown"
        )
    if paired.p_value < rules.promote_p:
        return None
    return (
        f"significance: round {c.round}'s win is not significant ({paired.sentence()}; "
        f"required below {rules.promote_p:g})"
    )


def judged_rows(body) -> dict:
    """An end's per-tool table as the fallen-tool rule judges it: the tools the round's slice
    never held (its `newTools`) as one row."""
    body = body if isinstance(body, dict) else {}
    rows = body.get("perTool") if isinstance(body.get("perTool"), dict) else {}
    new = body.get("newTools") if isinstance(body.get("newTools"), dict) else {}
    names = new.get("tools") if isinstance(new.get("tools"), list) else []
    return grouped(rows, [n for n in names if isinstance(n, str)])


def _no_fallen_tool(c: Candidate, rules: GateRules) -> str | None:
    if not rules.refuse_fallen:
        return None
    fell = fallen_tools(judged_rows(c.end_body), rules.fall_rule())
    if not fell:
        return None
    named = ", ".join(f"{fallen_name(f)} {f['before']} -> {f['after']}" for f in fell[:5])
    return (
        f"no fallen tool: round {c.round} has tools that fell by more than "
        f"{rules.fall_points:g} points: {named}"
    )


def _marks(exam) -> str | None:
    return exam.get("marks") if isinstance(exam, dict) else None
