"""The stratified draw of a slice (SPEC §6): one implementation, used by the device and the hub.

Proportional to the corpus, with a floor and a cap: every tool present gets at least FLOOR turns,
none more than CAP_SHARE of the draw, and the draw is never longer than asked. Round-robin dealing
was tried first and erased the distribution (forty tools at equal weight): the round learned only
the rare tools. Works on indices and the tool/tier of each line, so nothing is parsed to draw.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict

FLOOR = 4
CAP_SHARE = 0.15


def quotas(
    counts: dict[str, int], want: int, floor: int = FLOOR, cap_share: float = CAP_SHARE
) -> dict[str, int]:
    """How many turns each tool gets in a draw of at most `want` from a corpus with these counts.

    Each tool starts at its proportional share, raised to the floor and held under the cap. Then
    the total is settled: when over, the turns the floor added give way first, smallest tool first,
    then what rounding added, then every tool down to one turn (with more tools than turns, the
    smallest go without), smallest first each time; when
    under, the tools with turns left take more, largest first, up to the cap. The cap holds: a
    corpus with too few tools to fill the budget under it gives a shorter draw.
    """
    counts = {tool: n for tool, n in counts.items() if n > 0}
    total = sum(counts.values())
    if want <= 0 or total == 0:
        return {tool: 0 for tool in counts}
    cap = max(1, math.floor(cap_share * want))
    share = {tool: want * n / total for tool, n in counts.items()}
    quota = {tool: min(n, cap, max(floor, round(share[tool]))) for tool, n in counts.items()}
    smallest_first = sorted(counts, key=lambda t: (counts[t], t))
    largest_first = smallest_first[::-1]

    # More tools than turns: the smallest go without, so the largest keep their shape.
    without = set(smallest_first[: max(0, len(counts) - want)])
    over = sum(quota.values()) - want
    for least in (
        lambda t: max(1, round(share[t])),  # what the floor added
        lambda t: max(1, math.floor(share[t])),  # what rounding up added
        lambda t: 1,
    ):
        # One turn at a time, one tool after another, smallest first, so floors shrink evenly.
        while over > 0:
            giving = [t for t in smallest_first if quota[t] > (0 if t in without else least(t))]
            if not giving:
                break
            for tool in giving:
                if over == 0:
                    break
                quota[tool] -= 1
                over -= 1

    under = -over
    while under > 0:
        taking = [t for t in largest_first if quota[t] < min(counts[t], cap)]
        if not taking:
            break
        for tool in taking:
            if under == 0:
                break
            quota[tool] += 1
            under -= 1
    return quota


def draw(
    tools: list[str],
    tiers: list[str],
    want: int,
    seed: int,
    exclude: set[int] | None = None,
    floor: int = FLOOR,
    cap_share: float = CAP_SHARE,
) -> list[int]:
    """Indices of a slice of at most `want` turns: per-tool quotas, gold before silver, shuffled."""
    rng = random.Random(seed)
    exclude = exclude or set()
    groups: dict[str, dict[str, list[int]]] = defaultdict(lambda: {"gold": [], "silver": []})
    for i, (tool, tier) in enumerate(zip(tools, tiers, strict=True)):
        if i not in exclude:
            groups[tool]["gold" if tier == "gold" else "silver"].append(i)
    counts = {tool: len(g["gold"]) + len(g["silver"]) for tool, g in groups.items()}
    picked: list[int] = []
    for tool, n in sorted(quotas(counts, want, floor, cap_share).items()):
        gold, silver = groups[tool]["gold"], groups[tool]["silver"]
        rng.shuffle(gold)
        rng.shuffle(silver)
        picked.extend((gold + silver)[:n])
    rng.shuffle(picked)
    return picked
