"""The stratified draw of a slice (SPEC §6): one implementation, used by the device and the hub.

Proportional to the corpus, with a floor and a cap: every tool present gets at least FLOOR turns,
none more than CAP_SHARE of the draw. Round-robin dealing was tried first and erased the
distribution (forty tools at equal weight): the round learned only the rare tools.
Works on indices and the tool/tier of each line, so nothing is parsed to draw.
"""

from __future__ import annotations

import random
from collections import defaultdict

FLOOR = 4
CAP_SHARE = 0.15


def quotas(
    counts: dict[str, int], want: int, floor: int = FLOOR, cap_share: float = CAP_SHARE
) -> dict[str, int]:
    """How many turns each tool gets in a draw of `want` from a corpus with these counts."""
    total = sum(counts.values())
    if want >= total:
        return dict(counts)
    cap = max(floor, int(cap_share * want))
    quota = {}
    for tool, n in counts.items():
        share = round(want * n / total)
        quota[tool] = min(n, max(floor, min(cap, share)))
    # Clamping moved the total off budget: settle it against the tools that still have room,
    # largest first, one turn at a time so no tool jumps past another.
    by_size = sorted(counts, key=lambda t: (-counts[t], t))
    missing = want - sum(quota.values())
    while missing > 0:
        room = [t for t in by_size if quota[t] < counts[t] and quota[t] < cap]
        if not room:
            # Every tool is at its cap or empty: the cap gives way before the budget does.
            room = [t for t in by_size if quota[t] < counts[t]]
        for tool in room:
            if missing == 0:
                break
            quota[tool] += 1
            missing -= 1
    while missing < 0:
        room = [t for t in by_size if quota[t] > min(floor, counts[t])]
        if not room:
            break
        for tool in room:
            if missing == 0:
                break
            quota[tool] -= 1
            missing += 1
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
    """Indices of a slice of `want` turns: per-tool quotas, gold before silver, shuffled."""
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
