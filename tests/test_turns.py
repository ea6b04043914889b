import json

import pytest

from gbray.data.turns import DataError, index_file, index_folder, tool_of_answer, tool_of_raw_line


def good(job="j-1", tool="open", tier="gold"):
    answer = json.dumps({"tool": tool, "args": {"n": 1}})
    return json.dumps(
        {
            "job": job,
            "tier": tier,
            "messages": [
                {"role": "system", "content": "tools"},
                {"role": "user", "content": "page"},
                {"role": "assistant", "content": answer},
            ],
        }
    )


def test_tool_off_raw_line_and_answer():
    assert tool_of_raw_line(good(tool="save_keywords").encode()) == "save_keywords"
    assert tool_of_raw_line(b'{"messages": []}') is None
    assert tool_of_answer('sure: {"tool" :  "read", "args": {}} {"tool":"open"}') == "read"
    assert tool_of_answer('{"tool": "rea') is None


def test_bad_lines_are_counted_never_fatal(tmp_path):
    path = tmp_path / "train.jsonl"
    lines = [
        good(),
        'this is not json {\\"tool\\":\\"open\\"',  # looks like a turn, is not JSON
        json.dumps({"job": "j", "text": "no messages, no tool"}),
        json.dumps(
            {
                "job": "j",
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": " "},
                ],
            }
        ),
        r'{"job": "x", "messages": {"content": "{\"tool\":\"open\"}"}}',  # tool in raw, no message list
        good(job="j-2", tool="read"),
        "",
    ]
    path.write_text("\n".join(lines) + "\n")
    index = index_file(path)
    turns = index.read(list(range(len(index))))
    assert [t["tool"] for t in turns] == ["open", "read"]
    assert index.bad.total == 4
    assert index.bad.counts["not JSON"] == 1
    assert index.bad.counts["no tool"] == 2
    assert index.bad.counts["no messages"] == 1


def test_folder_errors_say_what_is_wrong(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        index_folder(tmp_path / "nope")
    with pytest.raises(DataError, match="no train.jsonl"):
        index_folder(tmp_path)
    (tmp_path / "train.jsonl").write_text("")
    (tmp_path / "eval.jsonl").write_text(good() + "\n")
    with pytest.raises(DataError, match="no usable turns"):
        index_folder(tmp_path)


def test_a_corpus_in_the_other_wording_reads_as_well_as_the_default(tmp_path):
    """Nothing in reading turns depends on the default catalogue: invented tools, other phrasing."""
    from gbray.data.synth import SynthSettings, write_corpus

    tools = {}
    for wording in ("default", "alt"):
        write_corpus(
            SynthSettings(out=tmp_path / wording, turns=300, eval_turns=40, seed=11, tools=14,
                          prompt_tokens=180, wording=wording)
        )  # fmt: skip
        train, evaluation = index_folder(tmp_path / wording)
        assert train.bad.total == evaluation.bad.total == 0
        turns = train.read(list(range(len(train))))
        assert all(t["tool"] in t["system"] for t in turns)
        tools[wording] = {t["tool"] for t in turns}
    assert len(tools["alt"]) >= 10 and not tools["alt"] & tools["default"]
