import json

from gbray.data.fit import IGNORE, answer_ids, chat_prompt_ids, collate, fit_prompt, make_example
from gbray.data.turns import index_folder


def long_turn():
    observations = "\n".join(f"- step {i}: opened result {i} about topic {i}" for i in range(60))
    page = "Latest page:\nTitle: Article: rivers\n" + "\n".join(
        f"line {i} of the page text" for i in range(300)
    )
    return {
        "system": "Tools:\n- open\n- read",
        "user": f"Job j-9: rivers.\n\n{observations}\n\n{page}",
        "answer": json.dumps({"tool": "read", "args": {}}),
        "tool": "read",
    }


def test_short_turn_is_untouched(tokenizer):
    turn = {"system": "s", "user": "u", "answer": '{"tool":"open"}', "tool": "open"}
    ex = make_example(tokenizer, turn, max_len=512, answer_room=96)
    assert not ex.shortened
    assert ex.input_ids[: len(chat_prompt_ids(tokenizer, "s", "u"))] == chat_prompt_ids(
        tokenizer, "s", "u"
    )
    assert [t for t in ex.labels if t != IGNORE] == answer_ids(tokenizer, turn["answer"])


def test_long_turn_keeps_its_answer_and_drops_oldest_first(tokenizer):
    turn = long_turn()
    ex = make_example(tokenizer, turn, max_len=400, answer_room=96)
    assert ex.shortened and len(ex.input_ids) <= 400
    labelled = [t for t in ex.labels if t != IGNORE]
    assert labelled == answer_ids(tokenizer, turn["answer"])
    text = tokenizer.decode(ex.input_ids)
    # Oldest observations go first; the page's start stays, its end goes.
    assert "step 0:" not in text
    assert "Title: Article: rivers" in text
    assert "line 299" not in text


def test_observations_go_before_the_page(tokenizer):
    turn = long_turn()
    full = len(chat_prompt_ids(tokenizer, turn["system"], turn["user"]))
    few_lines = len(chat_prompt_ids(tokenizer, turn["system"], turn["user"].split("\n\n")[0]))
    ids, shortened = fit_prompt(tokenizer, turn["system"], turn["user"], full - 40)
    text = tokenizer.decode(ids)
    assert shortened and "line 299 of the page text" in text and "step 0:" not in text
    ids, _ = fit_prompt(tokenizer, turn["system"], turn["user"], few_lines + 30)
    assert len(ids) <= few_lines + 30


def test_no_turn_of_a_corpus_loses_its_answer(tokenizer, corpus):
    train, _ = index_folder(corpus)
    turns = train.read(list(range(60)))
    for max_len in (64, 128, 256):
        for turn in turns:
            ex = make_example(tokenizer, turn, max_len=max_len, answer_room=24)
            assert len(ex.input_ids) <= max_len
            assert any(t != IGNORE for t in ex.labels), "an all-masked turn reached the loss"
            assert ex.labels[-1] == tokenizer.eos_token_id or len(ex.input_ids) == max_len


def test_collate_masks_padding(tokenizer):
    a = make_example(
        tokenizer, {"system": "", "user": "a", "answer": '{"tool":"x"}', "tool": "x"}, 128, 24
    )
    b = make_example(tokenizer, long_turn(), 200, 24)
    batch = collate([a, b], tokenizer.pad_token_id)
    assert batch["input_ids"].shape == batch["labels"].shape == (2, len(b.input_ids))
    assert (batch["labels"][0, len(a.input_ids) :] == IGNORE).all()
    assert batch["attention_mask"][0].sum() == len(a.input_ids)


def test_a_window_fits_nine_in_ten_turns_within_its_floor_and_ceiling():
    from gbray.data.fit import window_for

    needs = [300] * 9 + [5000]  # one outlier is fitted, not sized for
    assert window_for(needs, floor=256, ceiling=8192) == 512
    assert window_for([2847] * 10, floor=1024, ceiling=8192) == 3072
    assert window_for([2847] * 10, floor=1024, ceiling=2048) == 2048  # the student's context
    assert window_for([300] * 10, floor=1024, ceiling=8192) == 1024  # never below its floor
    assert window_for([], floor=1024, ceiling=8192) == 1024


def test_making_many_examples_says_how_far_it_got(tokenizer, corpus):
    from gbray.data.fit import make_examples
    from gbray.data.turns import index_folder

    train, _ = index_folder(corpus)
    turns = train.read(list(range(25)))
    said = []
    examples, shortened = make_examples(
        tokenizer, turns, 160, 24, progress=lambda *a: said.append(a), every=10
    )
    assert [done for done, _ in said] == [10, 20]
    assert said[-1][1] == sum(e.shortened for e in examples[:20]) > 0
    assert shortened == sum(e.shortened for e in examples) and len(examples) == 25
