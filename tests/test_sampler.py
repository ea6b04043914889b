import random
from collections import Counter

import pytest

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


def test_the_cap_holds_when_the_corpus_cannot_fill_the_budget_under_it():
    tools, tiers = corpus()
    counts = Counter(tools[i] for i in draw(tools, tiers, 200, seed=1))
    assert sum(counts.values()) <= 200
    assert max(counts.values()) <= int(CAP_SHARE * 200)
    assert counts["open"] >= counts["read"] >= counts["rare0"]


def skewed_corpus(n_tools: int, size: int, seed: int) -> tuple[list[str], list[str]]:
    """A Zipf-like corpus: the field's shape (a few big tools, a long tail)."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** rng.uniform(0.6, 1.4) for k in range(n_tools)]
    tools = rng.choices([f"t{k}" for k in range(n_tools)], weights=weights, k=size)
    return tools, [rng.choice(("gold", "silver")) for _ in tools]


@pytest.mark.parametrize(
    "n_tools,size,seed", [(25, 300, 0), (40, 500, 1), (3, 60, 2), (12, 97, 3), (60, 240, 4)]
)
def test_never_over_budget_for_any_budget(n_tools, size, seed):
    tools, tiers = skewed_corpus(n_tools, size, seed)
    counts = Counter(tools)
    for want in range(1, size + 1):
        q = quotas(dict(counts), want)
        assert sum(q.values()) <= want, (want, q)
        assert max(q.values()) <= max(1, int(CAP_SHARE * want)), (want, q)
        assert all(0 <= q[t] <= counts[t] for t in counts)
        if want >= len(counts) * FLOOR * 2:
            # Floors that fit (under the cap) are kept.
            least = min(FLOOR, min(counts.values()), int(CAP_SHARE * want))
            assert min(q.values()) >= least, (want, q)
    assert len(draw(tools, tiers, 60, seed=seed)) <= 60


def test_sixty_of_twenty_five_tools_is_sixty():
    tools, tiers = skewed_corpus(25, 2000, 9)
    picked = draw(tools, tiers, 60, seed=0)
    assert len(picked) == 60 and len(set(picked)) == 60
    assert all(n >= 1 for n in Counter(tools[i] for i in picked).values())


def test_a_cpu_slice_over_the_synthetic_corpus_keeps_its_shape(tmp_path):
    from gbray.data.synth import SynthSettings, write_corpus
    from gbray.data.turns import index_folder

    write_corpus(SynthSettings(out=tmp_path, turns=4000, eval_turns=50, seed=0, prompt_tokens=80))
    train, _ = index_folder(tmp_path)
    corpus_counts = Counter(train.tools)
    assert len(corpus_counts) == 40
    picked = Counter(train.tools[i] for i in draw(train.tools, train.tiers, 120, seed=3))
    assert sum(picked.values()) == 120
    (top, n_top), (second, n_second) = corpus_counts.most_common(2)
    share = 120 * n_top / len(train)
    assert picked[top] == min(int(CAP_SHARE * 120), round(share)) > FLOOR
    assert picked[second] == round(120 * n_second / len(train))
    assert picked[top] > picked[second] > sorted(picked.values())[len(picked) // 2]


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
