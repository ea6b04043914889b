from collections import Counter

from gbray.data.sampler import CAP_SHARE, FLOOR, draw, quotas


def corpus():
    # A skewed corpus: one huge tool, a few medium, several rare ones.
    tools, tiers = [], []
    for tool, n in [("open", 600), ("read", 200), ("look", 120), ("save_keywords", 80)] + [
        (f"rare{i}", 6) for i in range(10)
    ]:
        for k in range(n):
            tools.append(tool)
            tiers.append("gold" if k % 3 == 0 else "silver")
    return tools, tiers


def test_floor_cap_and_budget():
    tools, tiers = corpus()
    picked = draw(tools, tiers, 120, seed=1)
    assert len(picked) == 120
    assert len(set(picked)) == 120
    counts = Counter(tools[i] for i in picked)
    for i in range(10):
        assert counts[f"rare{i}"] >= FLOOR
    assert counts["open"] <= int(CAP_SHARE * 120)
    assert counts["read"] <= int(CAP_SHARE * 120)


def test_cap_gives_way_only_when_the_corpus_cannot_fill_the_budget():
    tools, tiers = corpus()
    counts = Counter(tools[i] for i in draw(tools, tiers, 200, seed=1))
    assert sum(counts.values()) == 200
    assert counts["open"] >= counts["read"] >= counts["rare0"]


def test_proportional_between_uncapped_tools():
    counts = {"a": 1000, "b": 500, "c": 250, "d": 250}
    q = quotas(counts, 1000, floor=4, cap_share=0.6)
    assert sum(q.values()) == 1000
    assert q["a"] == 500 and q["b"] == 250 and q["c"] == 125


def test_gold_before_silver():
    tools, tiers = corpus()
    picked = draw(tools, tiers, 200, seed=3)
    by_tool = {}
    for i in picked:
        by_tool.setdefault(tools[i], []).append(tiers[i])
    for tool, got in by_tool.items():
        gold_available = sum(
            1 for t, tier in zip(tools, tiers, strict=False) if t == tool and tier == "gold"
        )
        assert got.count("gold") == min(len(got), gold_available), tool


def test_seed_moves_the_draw_and_repeats_it():
    tools, tiers = corpus()
    assert draw(tools, tiers, 150, seed=5) == draw(tools, tiers, 150, seed=5)
    assert set(draw(tools, tiers, 150, seed=5)) != set(draw(tools, tiers, 150, seed=6))


def test_want_more_than_corpus_takes_everything_and_exclude_is_respected():
    tools, tiers = corpus()
    assert sorted(draw(tools, tiers, 10_000, seed=0)) == list(range(len(tools)))
    excluded = set(range(0, len(tools), 2))
    assert not excluded & set(draw(tools, tiers, 100, seed=0, exclude=excluded))
