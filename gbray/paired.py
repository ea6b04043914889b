"""Before and after, paired: the same turns sat by two models. The discordant counts, the exact
McNemar p-value, and per tool what changed, with the tools that fell by more than a set amount.
Torch-free: the round reports it and the hub's promotion gate recomputes it from the marks."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

MARKS = re.compile(r"[01]*")


def mcnemar_p(only_after: int, only_before: int) -> float:
    """The exact two-sided McNemar p-value: under "no difference" each discordant turn is a fair
    coin, so p is twice the binomial tail of the smaller count (at most 1). Written out with
    math.comb because it is two lines and keeps scipy off the hub."""
    n = only_after + only_before
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(only_after, only_before) + 1))
    return min(1.0, 2 * tail / 2**n)


@dataclass(frozen=True)
class Paired:
    """The two exams turn by turn: `only_after` the turns only the new model got right,
    `only_before` those only the start got right."""

    only_after: int
    only_before: int
    both: int
    neither: int
    p_value: float

    @property
    def turns(self) -> int:
        return self.only_after + self.only_before + self.both + self.neither

    def sentence(self) -> str:
        return (
            f"{self.only_after} turns only the new adapter got right, {self.only_before} only "
            f"the start; McNemar p = {self.p_value:.3g}"
        )


def valid_marks(marks) -> bool:
    return isinstance(marks, str) and MARKS.fullmatch(marks) is not None


def pair(before: str | None, after: str | None) -> Paired | None:
    """The paired counts of two exams' marks (one "1"/"0" per turn, paper order), or None when
    either has none or they are not the same length (not the same paper)."""
    if not (valid_marks(before) and valid_marks(after)) or len(before) != len(after):
        return None
    counts = {(b, a): 0 for b in "01" for a in "01"}
    for b, a in zip(before, after, strict=True):
        counts[b, a] += 1
    only_after, only_before = counts["0", "1"], counts["1", "0"]
    return Paired(
        only_after=only_after,
        only_before=only_before,
        both=counts["1", "1"],
        neither=counts["0", "0"],
        p_value=mcnemar_p(only_after, only_before),
    )


def _fraction(cell) -> tuple[int, int] | None:
    """ "right/asked" as the per-tool table carries it."""
    if not isinstance(cell, str) or "/" not in cell:
        return None
    right, _, asked = cell.partition("/")
    if not (right.isdigit() and asked.isdigit()) or int(asked) == 0:
        return None
    return int(right), int(asked)


@dataclass(frozen=True)
class FallRule:
    """When a tool has fallen: asked at least `min_asked` times on the paper, its score fell by
    more than `points` percentage points, and it lost at least `min_turns` of its turns net.

    The score is the tool's F1, 2·right / (asked + answered), where the table says how often each
    exam answered the tool on any turn (else its agreement, right / asked): a start that answers
    one tool everywhere gets all that tool's turns right without knowing it, and losing that is
    no fall. `min_turns` keeps noise out: on a 150-turn paper of 40 tools a tool is asked about 4
    times, and 2/5 -> 0/5 is what an unchanged adapter does often; an unchanged tool loses 5 turns
    net less than once in 32 (each discordant turn a fair coin), and fewer when it also gained."""

    points: float = 20.0
    min_asked: int = 5
    min_turns: int = 5


def _answer_count(fraction: tuple[int, int], answered) -> int | None:
    right, _ = fraction
    if isinstance(answered, int) and not isinstance(answered, bool) and right <= answered:
        return answered
    return None


def _scores(before: tuple[int, int], after: tuple[int, int], row: dict) -> tuple[float, float]:
    """A tool's F1 in percent before and after where both exams' answer counts are sane
    integers, else its agreement on both sides (the old client sends no answer counts, nor does
    a baseline it told): one measure for both, or the fall is not a fall."""
    counts = (
        _answer_count(before, row.get("answered_before")),
        _answer_count(after, row.get("answered_after")),
    )
    if None in counts:
        return 100.0 * before[0] / before[1], 100.0 * after[0] / after[1]
    return tuple(
        200.0 * right / (asked + answered)
        for (right, asked), answered in zip((before, after), counts, strict=True)
    )


def fallen_tools(per_tool: dict, rule: FallRule) -> list[dict]:
    """The tools that fell by `rule`, most first, from a per-tool table of
    {tool: {before: "r/a", after: "r/a"}} (a group's row also lists its `members`)."""
    fell = []
    for tool, row in per_tool.items():
        if not isinstance(row, dict):
            continue
        before, after = _fraction(row.get("before")), _fraction(row.get("after"))
        if not before or not after or before[1] != after[1] or before[1] < rule.min_asked:
            continue
        score_before, score_after = _scores(before, after, row)
        points = score_after - score_before
        if points < -rule.points and before[0] - after[0] >= rule.min_turns:
            fell.append(
                {"tool": tool, "before": row["before"], "after": row["after"], "points": points,
                 **({"members": row["members"]} if isinstance(row.get("members"), list) else {})}
            )  # fmt: skip
    return sorted(fell, key=lambda f: f["points"])


NEW_TOOLS = "(new tools)"


def grouped(per_tool: dict, new: list[str] | set[str]) -> dict:
    """The per-tool table as the fallen-tool rule judges it: the tools the slice never held are
    one row, `(new tools)`, summed (each is asked a few times; together they are a measure)."""
    new = {t for t in new if isinstance(per_tool.get(t), dict)}
    if not new:
        return per_tool
    rows = {t: r for t, r in per_tool.items() if t not in new}
    group = {"asked": 0, "before": [0, 0], "after": [0, 0], "answered_before": 0,
             "answered_after": 0}  # fmt: skip
    for t in new:
        row = per_tool[t]
        for side in ("before", "after"):
            cell = _fraction(row.get(side))
            if cell is None:
                group[side] = None
            elif group[side] is not None:
                group[side] = [group[side][0] + cell[0], group[side][1] + cell[1]]
            answered = row.get(f"answered_{side}")
            if isinstance(answered, int) and group[f"answered_{side}"] is not None:
                group[f"answered_{side}"] += answered
            else:
                group[f"answered_{side}"] = None
        group["asked"] += row.get("asked") if isinstance(row.get("asked"), int) else 0
    for side in ("before", "after"):
        group[side] = f"{group[side][0]}/{group[side][1]}" if group[side] else None
    group["members"] = sorted(new)
    rows[NEW_TOOLS] = group
    return rows


def fallen_name(fell: dict) -> str:
    """A fallen tool's name; a group's with its members, e.g. `(new tools) [zoom, share]`."""
    members = [m for m in fell.get("members") or [] if isinstance(m, str)]
    return f"{fell['tool']} [{', '.join(members[:10])}]" if members else str(fell["tool"])


def comparison(
    before_marks: str | None, after_marks: str | None, per_tool: dict, rule: FallRule,
    new: list[str] = (),
) -> dict:  # fmt: skip
    """What round.json, the hub's end and the page carry about before vs after; the tools the
    slice never held (`new`) are judged as one group."""
    paired = pair(before_marks, after_marks)
    return {
        "paired": asdict(paired) if paired else None,
        "fell": fallen_tools(grouped(per_tool, new), rule),
        "fall_points": rule.points,
        "fall_min_asked": rule.min_asked,
        "fall_min_turns": rule.min_turns,
    }
