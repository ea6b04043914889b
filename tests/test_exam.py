"""The exam: fast (batched, shared prefix cached, answers ended at their tool) and exact (the same
tool on every turn as plain one-turn-at-a-time generate with the whole budget, near-ties
reported); and honest (paired counts and the exact McNemar p-value)."""

import math

import pytest

from gbray.paired import FallRule, comparison, fallen_tools, mcnemar_p, pair

# -- paired -------------------------------------------------------------------------------------


def binomial_two_sided(k: int, n: int) -> float:
    """The exact two-sided binomial test at 1/2 by summing every outcome as likely or less
    (the textbook definition, independent of the tail formula under test)."""
    probs = [math.comb(n, i) / 2**n for i in range(n + 1)]
    return min(1.0, sum(p for p in probs if p <= probs[k] * (1 + 1e-12)))


@pytest.mark.parametrize("b,c", [(0, 0), (1, 0), (10, 0), (10, 2), (3, 1), (7, 6), (40, 25)])
def test_mcnemar_p_is_the_exact_binomial_test_of_the_discordant_turns(b, c):
    assert mcnemar_p(b, c) == pytest.approx(binomial_two_sided(min(b, c), b + c) if b + c else 1)
    assert mcnemar_p(b, c) == mcnemar_p(c, b)


def test_mcnemar_p_known_values():
    assert mcnemar_p(0, 0) == 1.0
    assert mcnemar_p(10, 0) == pytest.approx(2 / 1024)
    assert mcnemar_p(10, 2) == pytest.approx(0.03857, abs=1e-5)  # binomtest(2, 12)
    # Won by one turn in 150: nowhere near significant.
    assert mcnemar_p(4, 3) == 1.0


def test_pair_counts_each_kind_of_turn():
    p = pair("110010", "011011")
    assert (p.only_after, p.only_before, p.both, p.neither) == (2, 1, 2, 1)
    assert p.turns == 6 and p.p_value == mcnemar_p(2, 1)
    assert pair("1100", "110") is None  # not the same paper
    assert pair(None, "1") is None and pair("1x", "10") is None


def test_a_tool_that_fell_is_flagged_only_past_the_amount_and_the_floor():
    rows = {
        "open": {"asked": 10, "before": "8/10", "after": "3/10"},  # -50 points
        "click": {"asked": 10, "before": "8/10", "after": "7/10"},  # -10
        "rare": {"asked": 2, "before": "2/2", "after": "0/2"},  # asked too rarely
        "new": {"asked": 6, "before": None, "after": "1/6"},
    }
    rule = FallRule(points=20, min_asked=5, min_turns=5)
    fell = fallen_tools(rows, rule)
    assert [f["tool"] for f in fell] == ["open"] and fell[0]["points"] == -50
    out = comparison("10", "01", rows, rule)
    assert out["paired"]["only_after"] == 1 and [f["tool"] for f in out["fell"]] == ["open"]
    # A fall of a few turns is what an unchanged adapter shows by chance: not flagged, however
    # many points it is on a tool asked a few times.
    few = {"scroll": {"asked": 5, "before": "2/5", "after": "0/5"}}
    assert fallen_tools(few, rule) == []
    assert [f["tool"] for f in fallen_tools(few, FallRule(20, 5, min_turns=2))] == ["scroll"]
    # A start that answered one tool on every turn of the paper got that tool's turns right
    # without knowing it: losing them is no fall. Knowing it (answered where asked) and losing
    # it is.
    everywhere = {"open": {"asked": 8, "before": "8/8", "after": "0/8",
                           "answered_before": 150, "answered_after": 3}}  # fmt: skip
    assert fallen_tools(everywhere, rule) == []
    known = {"open": {**everywhere["open"], "answered_before": 9}}
    fell = fallen_tools(known, rule)
    assert [f["tool"] for f in fell] == ["open"] and round(fell[0]["points"]) == -94


def test_shared_prefix_leaves_each_prompt_a_token_of_its_own():
    from gbray.examiner import shared_prefix

    assert shared_prefix([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 9]]) == [1, 2]
    assert shared_prefix([[1, 2, 3], [1, 2, 3]]) == [1, 2]
    assert shared_prefix([[7], [1, 2]]) == []


def test_the_cache_is_passed_by_the_name_the_installed_transformers_takes():
    from gbray.examiner import cache_argument

    class Renamed:  # transformers 5.2x
        def forward(self, input_ids=None, cache=None, **kwargs): ...

    class Before:  # transformers 5.17: only the old name
        def forward(self, input_ids=None, past_key_values=None, **kwargs): ...

    assert cache_argument(Renamed()) == "cache"
    assert cache_argument(Before()) == "past_key_values"


# -- fast and exact -----------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["fused", "plain"])
def test_cascade_attention_is_attention_over_the_prefix_and_the_rows_own_keys(kernel, monkeypatch):
    """One copy of the prefix for every row, joined with each row's own (masked) keys by their
    log-sum-exps: the same as SDPA over each row's whole keys. `plain` is the path off a CPU."""
    import types

    import torch

    from gbray import examiner

    if kernel == "plain":
        monkeypatch.setattr(examiner, "_attend", examiner._attend_plain)
    torch.manual_seed(0)
    rows, heads, kv_heads, dim, prefix_len, own, queries = 3, 6, 2, 8, 11, 7, 2
    prefix = examiner.SharedPrefix(list(range(prefix_len)))
    prefix.keys = [None, torch.randn(1, kv_heads, prefix_len, dim)]
    prefix.values = [None, torch.randn(1, kv_heads, prefix_len, dim)]
    query = torch.randn(rows, heads, queries, dim)
    key, value = torch.randn(rows, kv_heads, own, dim), torch.randn(rows, kv_heads, own, dim)
    mask = torch.rand(rows, 1, queries, own) > 0.4
    mask[..., -1] = True  # each query sees at least itself
    module = types.SimpleNamespace(layer_idx=1, num_key_value_groups=heads // kv_heads)
    out, _ = examiner.cascade_attention(module, query, key, value, mask, shared_prefix=prefix)

    whole_k = torch.cat([prefix.keys[1].expand(rows, -1, -1, -1), key], 2)
    whole_v = torch.cat([prefix.values[1].expand(rows, -1, -1, -1), value], 2)
    whole_mask = torch.cat([torch.ones(rows, 1, queries, prefix_len, dtype=torch.bool), mask], -1)
    want = torch.nn.functional.scaled_dot_product_attention(
        query,
        whole_k.repeat_interleave(heads // kv_heads, 1),
        whole_v.repeat_interleave(heads // kv_heads, 1),
        attn_mask=whole_mask,
    ).transpose(1, 2)
    assert out.shape == (rows, queries, heads, dim)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # Past the mask's columns the batch's cache is not read: the answer's room ahead is empty.
    wider_k = torch.cat([key, torch.full((rows, kv_heads, 5, dim), float("nan"))], 2)
    wider_v = torch.cat([value, torch.full((rows, kv_heads, 5, dim), float("nan"))], 2)
    again, _ = examiner.cascade_attention(
        module, query, wider_k, wider_v, mask, shared_prefix=prefix
    )
    torch.testing.assert_close(again, out)


def divergence(a, b) -> int:
    return next(
        (k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def check_exact(examiner, paper, batch=20, budget=320):
    """The fast exam against plain generation: every tool the same, and every fast answer the
    plain answer's beginning, except where the two diverge at a near-tie (reported)."""
    from gbray.data.fit import fit_prompt
    from gbray.examiner import near_ties
    from gbray.settings import ExamMode

    prompts = [fit_prompt(examiner.tokenizer, t["system"], t["user"], 512)[0] for t in paper]
    # Batches of `batch` turns: each goes through the model's prefill in parts (PREFILL_ROWS),
    # and its rows leave one by one as they finish.
    fast = examiner.answers(prompts, budget, ExamMode(batch=batch))
    assert examiner.prefix_tokens > 16
    plain = examiner.answers(prompts, budget, ExamMode.plain())
    ties, reported = [], {t["turn"] for t in near_ties(fast, 1e-4)}
    for turn, (f, q) in enumerate(zip(fast, plain, strict=True)):
        step = divergence(f.tokens, q.tokens)
        if step < len(f.tokens):  # the fast answer is not the plain answer's beginning
            margin = min(f.margins[step], q.margins[step])
            ties.append({"turn": turn, "step": step, "margin": margin, "tools": (f.tool, q.tool)})
            assert margin < 1e-4, ties[-1]
            assert turn in reported  # the exam itself reports it
        else:
            assert f.tool == q.tool, (turn, f.text, q.text)
    if ties:
        print("near-ties (turn, step, margin, fast/plain tool):", ties)
    return fast, plain, {t["turn"] for t in ties}


def paper_from(corpus, turns):
    from gbray.data.turns import index_folder
    from gbray.work import paper_of

    _, evaluation = index_folder(corpus)
    return paper_of(evaluation, turns)[0]


def test_the_fast_exam_names_the_same_tool_as_plain_generate_on_the_tiny_student(learnable):
    from gbray.examiner import Examiner

    data, student = learnable
    examiner = Examiner(str(student), None, "float32", 2, "cpu")
    fast, plain, tied = check_exact(examiner, paper_from(data, 60))
    named = sum(a.tool is not None for a in plain)
    assert named >= 30, named  # the case that matters: answers that name tools
    # Ending at the tool saved tokens, and only where a tool was named.
    assert sum(len(a.tokens) for a in fast) < sum(len(a.tokens) for a in plain)
    for turn, (f, q) in enumerate(zip(fast, plain, strict=True)):
        if q.tool is None and turn not in tied:
            assert f.tokens == q.tokens


def test_validation_names_the_tool_on_the_turns_the_exam_does(learnable, tmp_path):
    """Greedy decoding follows the recorded answer up to the end of its tool's name exactly
    when each of those tokens is the argmax under teacher forcing: a validation pass marks
    the same turns right as the exam (SPEC §5)."""
    from gbray.data.fit import make_examples
    from gbray.examiner import Examiner
    from gbray.settings import ExamMode, Recipe
    from gbray.trainer import Trainer

    data, student = learnable
    # 120 turns: the bare student names the right tool on about two in a hundred.
    paper = paper_from(data, 120)
    recipe = Recipe(max_len=768, exam_batch=16, threads=2, device="cpu", precision="float32")
    exam = Examiner(str(student), None, "float32", 2, "cpu").exam(
        paper, 320, 768, ExamMode.of(recipe)
    )
    # A fresh LoRA is the bare student (its B matrices are zero).
    trainer = Trainer(str(student), None, recipe, tmp_path)
    examples, _ = make_examples(trainer.tokenizer, paper, 768, recipe.answer_room)
    _, marks = trainer.validation_scores(examples)
    assert 1 <= marks.count("1") < len(marks), marks  # the pre-trained student names tools
    assert marks == exam.marks


def test_the_fast_exam_matches_plain_generate_on_a_random_weight_qwen2(raw_student, corpus):
    """Random weights: nonsense to the answer budget on every turn, the longest answers there
    are; every token must match, except across a near-tie."""
    from transformers import AutoConfig

    from gbray.examiner import Examiner

    assert AutoConfig.from_pretrained(raw_student).model_type == "qwen2"
    examiner = Examiner(str(raw_student), None, "float32", 2, "cpu")
    # 20 turns in batches of 18 (prefilled in two parts, then a batch of 2) and 192 tokens an
    # answer: plain generation, a turn at a time, is most of this test's time.
    fast, plain, tied = check_exact(examiner, paper_from(corpus, 20), batch=18, budget=192)
    assert all(len(q.tokens) == 192 for q in plain)
    same = [
        turn for turn, (f, q) in enumerate(zip(fast, plain, strict=True)) if f.tokens == q.tokens
    ]
    assert set(range(20)) - set(same) <= tied


def test_the_full_answer_mode_generates_to_the_budget(learnable):
    from gbray.examiner import Examiner
    from gbray.settings import ExamMode, Recipe

    data, student = learnable
    examiner = Examiner(str(student), None, "float32", 2, "cpu")
    paper = paper_from(data, 16)
    recipe = Recipe(exam_full_answers=True, exam_batch=8, max_len=768)
    full = examiner.exam(paper, 320, 768, ExamMode.of(recipe))
    short = examiner.exam(paper, 320, 768, ExamMode.of(Recipe(exam_batch=8, max_len=768)))
    assert full.stop_at_tool is False and short.stop_at_tool is True
    assert full.marks == short.marks and len(full.marks) == 16
    assert full.generated_tokens > short.generated_tokens


def test_new_tools_are_the_papers_turns_whose_tool_the_slice_never_held():
    from gbray.hub.gate import GateRules, judged_rows
    from gbray.record import compare, new_tools, per_tool
    from gbray.results import ExamResult

    asked = ["open"] * 10 + ["zoom"] * 3 + ["share"] * 3 + ["read"] * 4
    before = ExamResult(**_exam(asked, ["open"] * 10 + ["zoom"] * 3 + ["open"] * 7))
    after = ExamResult(**_exam(asked, ["open"] * 10 + ["read"] * 6 + ["read"] * 4))
    new = new_tools(before, after, slice_tools={"open", "read", "click"})
    # zoom and share were on the paper, never in the slice: 6 turns, 3 right before, 0 after.
    assert new == {"tools": ["share", "zoom"], "asked": 6, "before": 3, "after": 0,
                   "before_pct": 50.0, "after_pct": 0.0}  # fmt: skip
    assert new_tools(before, after, slice_tools=set()) is None  # nothing trained
    assert new_tools(before, after, slice_tools={"open", "zoom", "share", "read"}) is None
    # The fallen-tool rule judges them as one group: each is asked too rarely alone.
    rule = FallRule(points=20, min_asked=5, min_turns=3)
    rows = per_tool(before, after)
    assert fallen_tools(rows, rule) == []
    compared = compare(before, after, rule, new["tools"])
    assert [f["tool"] for f in compared["fell"]] == ["(new tools)"]
    # The hub judges an end the same way, from its perTool and newTools.
    body = {"perTool": rows, "newTools": new}
    assert "(new tools)" in judged_rows(body) and "zoom" not in judged_rows(body)
    assert GateRules(refuse_fallen=True, fall_min_turns=3).fall_rule() == rule


def _exam(asked, answered):
    from gbray.examiner import score

    return score(asked, answered)


def test_a_known_baseline_keeps_its_per_tool_counts_so_a_fall_from_it_is_judged():
    """A round whose baseline the hub knew (told by the round that measured it, or the result of
    the night it starts from) compares tools as one that measured it: the counts travel with
    the told baseline; from the old client, which sends none, they are rebuilt from the marks
    and the paper, and the rule then compares agreement on both sides."""
    from gbray.record import per_tool
    from gbray.results import ExamResult

    asked = ["open"] * 10 + ["read"] * 6 + ["click"] * 4
    before = ExamResult(**_exam(asked, ["open"] * 10 + ["read"] * 6 + ["open"] * 4))
    after = ExamResult(**_exam(asked, ["open"] * 10 + ["open"] * 6 + ["open"] * 4))
    rule = FallRule(points=20, min_asked=5, min_turns=3)
    measured = fallen_tools(per_tool(before, after), rule)
    assert [f["tool"] for f in measured] == ["read"]

    told = ExamResult.from_hub(before.on_the_wire(per_tool=True), "dev")
    assert told.source == "hub" and told.per_tool == before.per_tool
    assert fallen_tools(per_tool(told, after), rule) == measured
    # The end body's baseline carries no per-tool counts (the perTool table does).
    assert "per_tool" not in before.on_the_wire()

    # The old client's told baseline: marks only. Rebuilt from the paper's tools.
    bare = ExamResult.from_hub(before.on_the_wire(), "old")
    assert bare.per_tool == {}
    rebuilt = bare.with_tools_from_marks(asked)
    assert rebuilt.per_tool == {"open": {"asked": 10, "right": 10},
                                "read": {"asked": 6, "right": 6},
                                "click": {"asked": 4, "right": 0}}  # fmt: skip
    rows = per_tool(rebuilt, after)
    assert rows["read"]["answered_before"] is None and rows["read"]["before"] == "6/6"
    fell = fallen_tools(rows, rule)
    assert [f["tool"] for f in fell] == ["read"] and fell[0]["points"] == -100  # agreement
    assert bare.with_tools_from_marks(asked[:-1]) is bare  # another paper: left as it is


@pytest.mark.parametrize(
    "tamper",
    [
        lambda rows: rows["open"].update(right=11),  # more right than asked
        lambda rows: rows["open"].update(asked=True),  # a bool is not a count
        lambda rows: rows["read"].update(asked=7),  # the turns do not add up
        lambda rows: rows["read"]["instead"].update(open=-1),
        lambda rows: rows.update(zoom="all of them"),
    ],
)
def test_a_told_baselines_per_tool_counts_that_do_not_add_up_are_left_out(tamper):
    from gbray.results import ExamResult

    asked = ["open"] * 10 + ["read"] * 6
    exam = ExamResult(**_exam(asked, ["open"] * 12 + ["read"] * 4))
    wire = exam.on_the_wire(per_tool=True)
    assert ExamResult.from_hub(wire, "dev").per_tool == exam.per_tool
    tamper(wire["per_tool"])
    known = ExamResult.from_hub(wire, "dev")
    assert known.per_tool == {} and known.marks == exam.marks


def test_the_fall_rule_compares_one_measure_on_both_sides():
    """F1 where both exams counted what was answered, agreement where either did not: a
    baseline without answer counts beside a result with them is no fall of 60 points."""
    mixed = {"open": {"asked": 8, "before": "8/8", "after": "7/8", "answered_after": 20}}
    rule = FallRule(points=20, min_asked=5, min_turns=1)
    assert fallen_tools(mixed, rule) == []  # 100 -> 87.5, not 100 -> 50
    both = {"open": {**mixed["open"], "answered_before": 8}}
    assert round(fallen_tools(both, rule)[0]["points"]) == -50
