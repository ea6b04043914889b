"""`gbray synth --hard`: turns that no one field decides. A count-based classifier (naive Bayes on
the words of one field) is checked against chance, and the three fields together against the
label; the same classifier on the default corpus shows it can find a field that decides."""

import json
import math
import random
import re
from collections import Counter, defaultdict

import pytest

from gbray.data.synth import (
    HARD_SECTIONS,
    WAYS,
    WORDINGS,
    SynthSettings,
    tool_table,
    write_corpus,
)

FIELDS = ("task", "history", "page")


def fields(turn: dict, wording) -> dict:
    head, rest = turn["messages"][1]["content"].split("\n\n", 1)
    history, _, page = rest.rpartition(wording.page)
    return {"task": head, "history": history, "page": page}


def label(turn: dict) -> str:
    return json.loads(turn["messages"][2]["content"])["tool"]


def read(path, wording):
    turns = [json.loads(line) for line in path.read_text().splitlines()]
    return [(fields(t, wording), label(t), t["tier"]) for t in turns]


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9_]+", text.lower()))


def naive_bayes(train, field: str):
    """Counts of each word per tool (present or not), Laplace-smoothed; the tool with the
    highest log-probability of the words it sees."""
    prior, seen = Counter(), defaultdict(Counter)
    for f, tool, _ in train:
        prior[tool] += 1
        seen[tool].update(words(f[field]))

    def classify(f) -> str:
        ws = words(f[field])
        return max(
            prior,
            key=lambda t: (
                math.log(prior[t]) + sum(math.log((seen[t][w] + 1) / (prior[t] + 2)) for w in ws)
            ),
        )

    return classify


def accuracy(classify, turns, field) -> float:
    gold = [(f, tool) for f, tool, tier in turns if tier == "gold"]
    return sum(classify(f) == tool for f, tool in gold) / len(gold)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    out = {}
    for name, hard in (("hard", True), ("plain", False)):
        folder = tmp_path_factory.mktemp(name)
        write_corpus(SynthSettings(out=folder, turns=5000, eval_turns=1500, seed=3, hard=hard))
        w = WORDINGS["default"]
        out[name] = (read(folder / "train.jsonl", w), read(folder / "eval.jsonl", w))
    return out


def test_no_one_field_of_a_hard_turn_names_its_tool(corpora):
    train, evals = corpora["hard"]
    tools = {tool for _, tool, _ in train}
    chance = 1 / len(tools)  # the targets are drawn evenly
    seen = {f: accuracy(naive_bayes(train, f), evals, f) for f in FIELDS}
    assert all(a <= 2 * chance for a in seen.values()), (seen, chance)
    # The same classifier finds the field that decides a default turn: its page.
    plain_train, plain_eval = corpora["plain"]
    assert accuracy(naive_bayes(plain_train, "page"), plain_eval, "page") > 0.9


def under_headings(page: str) -> dict[str, list[str]]:
    """The page's listed elements, by the heading they sit under."""
    sections, heading = {}, None
    for element in re.findall(r"^\[\d+\] (.+)$", page, flags=re.M):
        if element.startswith("section "):
            heading = element[len('section "') : -1].lower()
            sections[heading] = []
        else:
            sections[heading].append(element)
    return sections


def test_the_page_the_task_and_the_history_together_name_it(corpora):
    train, _ = corpora["hard"]
    table = tool_table(SynthSettings(out=None, seed=3, hard=True), random.Random(3))
    owner = {e: name for name, _, _, signature in table for e in signature}
    assert len(owner) == 3 * len(table)  # every cue belongs to one tool
    phrases = [phrase for split in WAYS for phrase in split]
    lines, near_misses = [], []
    for f, tool, tier in train:
        if tier != "gold":
            continue
        sections = under_headings(f["page"])
        way = next(p for p in phrases if p in f["task"])
        offered = {owner[e] for e in sections[way] if e in owner}
        used = set(re.findall(r"^- (\w+) \[\d+\]: used on this page", f["history"], flags=re.M))
        assert offered - used == {tool}
        # Near misses: tools under the task's heading that were used already.
        near_misses.append(len(offered) - 1)
        # Under every other heading too, one tool was used and one was not.
        open_elsewhere = {owner[e] for w, es in sections.items() if w != way for e in es
                          if e in owner} - used  # fmt: skip
        assert len(open_elsewhere) == HARD_SECTIONS - 1
        lines.append(f["history"].count("\n- "))
    assert set(near_misses) == {1} and sum(lines) / len(lines) > 12


def test_new_tools_are_never_a_training_label_but_are_on_the_paper(tmp_path):
    counts = write_corpus(SynthSettings(out=tmp_path, turns=3000, eval_turns=300, seed=4,
                                        new_tools=4))  # fmt: skip
    new = set(counts["new_tools"])
    assert len(new) == 4
    w = WORDINGS["default"]
    train, paper = read(tmp_path / "train.jsonl", w), read(tmp_path / "eval.jsonl", w)[:150]
    assert not new & {tool for _, tool, _ in train}
    assert sum(tool in new for _, tool, _ in paper) >= 30
    # The catalogue still lists and describes them.
    system = json.loads((tmp_path / "train.jsonl").read_text().splitlines()[0])["messages"][0]
    assert all(f"- {t}: for " in system["content"] for t in new)
    with pytest.raises(ValueError):
        SynthSettings(out=tmp_path, new_tools=11).validate()
