"""The round's branches on an in-process cluster (gbray.local_cluster): the same Round as on Ray,
with the raw tiny student, in seconds. How the baseline is had, a share lost mid-night, and
what the result exam takes after shares (merged, averaged, the one survivor, the field's
`merge:` syntax)."""

import json
import shutil

import pytest
import requests

from gbray.local_cluster import LocalCluster
from gbray.round import run_round, start_name
from gbray.settings import Recipe, RoundSettings


def recipe(**kw) -> Recipe:
    base = dict(
        hours=0.05, epochs=1, turns=24, batch=4, accum=1, lr=1e-3, lora_r=4, lora_alpha=8,
        max_len=384, val_turns=8, val_every_steps=3, exam_turns=12, answer_budget=24,
        progress_every_minutes=1, gradient_checkpointing=False, seed=5, threads=1,
    )  # fmt: skip
    return Recipe(**{**base, **kw})


def night(corpus, student, out, cluster=None, **kw) -> dict:
    settings = RoundSettings(
        data=corpus, model=str(student), out=out, recipe=kw.pop("recipe", recipe()), **kw
    )
    record = run_round(settings, cluster or LocalCluster())
    assert json.loads((out / "round.json").read_text())["status"] == record["status"]
    return record


def test_a_round_in_one_process_trains_and_examines_its_start_before(corpus, raw_student, tmp_path):
    # A bad line of each kind in the slice's file: counted in round.json, never fatal.
    data = tmp_path / "data"
    shutil.copytree(corpus, data)
    with open(data / "train.jsonl", "a") as f:
        f.write('not json at all\n{"job": "x", "messages": []}\n')
    record = night(data, raw_student, tmp_path / "r")
    assert record["status"] == "done", record.get("why")
    assert record["bad_lines"]["train"]["total"] == 2
    assert record["baseline"]["turns"] == record["result"]["turns"] == 12
    assert record["turn_passes"] >= 24
    assert (tmp_path / "r" / "best" / "adapter_config.json").is_file()
    # The resolved recipe is written beside the adapter, each value with where it came from.
    written = json.loads((tmp_path / "r" / "recipe.json").read_text())
    assert written["lr"] == 1e-3 and "student.json" in written["why"]["lr"]


@pytest.fixture(scope="module")
def two_shares(corpus, raw_student, tmp_path_factory):
    """Two shares merged with `cat`, the baseline measured beside them (the cluster has room)."""
    out = tmp_path_factory.mktemp("shares") / "r"
    record = night(
        corpus, raw_student, out, LocalCluster(room=True), shares=2, share_average_minutes=0
    )
    return record, out


def test_two_shares_are_merged_and_the_baseline_measured_beside_them(two_shares):
    record, out = two_shares
    assert record["status"] == "done", record.get("why")
    assert record["merge"]["method"] == "cat" and record["merge"]["exact"]
    assert record["adapter"] == str(out / "merged")
    assert sum(record["share_split"]) == record["slice_turns"] and len(record["share_split"]) == 2
    reports = record["share_reports"]
    assert [r["turns"] for r in reports] == record["share_split"] and not record["lost_shares"]
    assert record["turns_trained"] == sum(r["training"]["turns_trained"] for r in reports)
    assert record["baseline"]["source"] == "exam" and record["result"]["turns"] == 12


def test_a_share_lost_mid_night_is_named_and_the_survivor_is_the_result(
    corpus, raw_student, tmp_path
):
    gone = "its machine went away (test)"
    record = night(
        corpus, raw_student, tmp_path / "r", LocalCluster(lose={1: gone}), shares=2,
        share_average_minutes=0, skip_baseline=True,
    )  # fmt: skip
    assert record["status"] == "done", record.get("why")
    assert record["baseline"] is None and len(record["exam_pids"]) == 1  # skipped: asked
    [lost] = record["lost_shares"]
    assert lost["share"] == 1 and lost["why"] == gone and lost["minute"] is not None
    reports = record["share_reports"]
    assert reports[1]["lost"] == gone and reports[1]["training"] is None
    assert "merge" not in record  # one survivor: its adapter is the result, nothing merged
    assert record["adapter"] == reports[0]["training"]["adapter"]
    assert record["turns_trained"] == reports[0]["training"]["turns_trained"]


def test_averaged_shares_keep_what_a_lost_share_synced(corpus, raw_student, tmp_path):
    record = night(
        corpus, raw_student, tmp_path / "r", LocalCluster(lose={0: "gone (test)"}), shares=2,
        share_average_minutes=0.001, skip_baseline=True,
    )  # fmt: skip
    assert record["status"] == "done", record.get("why")
    merge = record["merge"]
    assert merge["method"] == "outer" and record["adapter"] == merge["folder"]
    synced = {s["share"] for s in merge["syncs"]}
    assert synced == {0, 1}  # the lost share's syncs are in the global adapter
    members = {m["share"]: m for m in merge["members"]}
    assert members[0]["left_minute"] is not None and members[0]["turns_synced"] > 0
    assert [x["share"] for x in record["lost_shares"]] == [0]


def test_a_night_whose_every_share_is_lost_fails_and_says_why(corpus, raw_student, tmp_path):
    lose = {0: "gone (test)", 1: "gone too (test)"}
    with pytest.raises(RuntimeError, match="no share survived: share 0: gone"):
        night(
            corpus, raw_student, tmp_path / "r", LocalCluster(lose=lose), shares=2,
            share_average_minutes=0, skip_baseline=True,
        )  # fmt: skip
    record = json.loads((tmp_path / "r" / "round.json").read_text())
    assert record["status"] == "failed" and "no share survived" in record["why"]
    assert len(record["lost_shares"]) == 2 and record["result"] is None


def test_the_fields_merge_syntax_joins_adapters_by_fedavg_and_trains_nothing(
    two_shares, corpus, raw_student, tmp_path
):
    shares, _ = two_shares
    folders = [r["training"]["adapter"] for r in shares["share_reports"]]
    record = night(
        corpus, raw_student, tmp_path / "r", adapter="merge:" + ",".join(folders),
        skip_baseline=True,
    )  # fmt: skip
    assert record["status"] == "done", record.get("why")
    assert record["merge"]["method"] == "fedavg" and record["merge"]["weights"] == [0.5, 0.5]
    assert "steps" not in record and record["result"]["turns"] == 12


def test_a_baseline_another_device_measures_is_waited_for_then_known_to_the_next_round(
    corpus, raw_student, tmp_path
):
    """The hub says another device is measuring the start: the round trains at once and reads
    the baseline at the end; it never arrives, so the round measures it then. The next round
    finds it known on the hub and examines only its result."""
    from hubutil import HubProcess

    from gbray.hub.client import ClientSettings, HubClient
    from gbray.hub.store import Store
    from gbray.round import Round

    hub = HubProcess(tmp_path / "hub")
    Store(hub.db).load(corpus / "train.jsonl", corpus / "eval.jsonl")
    desktop = Store(hub.db).add_token("desktop", owner=False)
    hub.start()
    try:
        on_hub = dict(hub=hub.url, token=hub.device, recipe=recipe())
        first = Round(
            RoundSettings(data=corpus, model=str(raw_student), out=tmp_path / "key", **on_hub),
            LocalCluster(),
        )
        first.setup()
        key = first.baseline_key(first.work())
        other = HubClient(ClientSettings(url=hub.url, token=desktop, device="desktop"))
        assert other.ask_baseline(key)["measure"]  # the desktop takes the measuring on
        deferred = night(corpus, raw_student, tmp_path / "a", **on_hub)
        assert deferred["status"] == "done", deferred.get("why")
        assert deferred["baseline"]["source"] == "exam"  # measured at the end, not before
        notes = requests.get(
            f"{hub.url}/v1/training/rounds/{deferred['hub_round']}",
            headers=hub.headers("owner"),
            timeout=30,
        ).json()["notes"]
        said = [n["line"] for n in notes]
        began = said.index("baseline being measured by desktop; training at once")
        assert said.index("the baseline never arrived; measuring the start now") > began
        known = night(corpus, raw_student, tmp_path / "b", **on_hub)
        assert known["baseline"]["source"] == "hub"
        assert known["baseline"]["agreement_pct"] == deferred["baseline"]["agreement_pct"]
        assert len(known["exam_pids"]) == 1
    finally:
        hub.stop()


def test_the_students_own_window_grows_to_the_papers_turns_and_a_given_one_is_kept(
    raw_student, tmp_path
):
    """Turns longer than the tiny student's own max_len (1024, student.json): the round raises
    it to what nine in ten of the paper's turns need, so training and the exam see them whole;
    a window the settings give is kept (1024 here, as the command line's `--max-len 1024`), and
    the exam shortens every turn."""
    from gbray.data.synth import SynthSettings, write_corpus

    data = tmp_path / "data"
    write_corpus(SynthSettings(out=data, turns=60, eval_turns=12, seed=7, prompt_tokens=600))
    own = dict(recipe=recipe(max_len=1024), student_chose=("max_len",))
    record = night(data, raw_student, tmp_path / "own", **own)
    assert record["status"] == "done", record.get("why")
    written = json.loads((tmp_path / "own" / "recipe.json").read_text())
    window = written["max_len"]
    assert window > 1024 and window % 256 == 0 and record["recipe"]["max_len"] == window
    assert "raised from the student's 1024" in written["why"]["max_len"]
    assert record["baseline"]["shortened"] <= 1 and record["result"]["shortened"] <= 1
    assert record["shortened"] <= record["turns_trained"] // 5

    given = night(
        data, raw_student, tmp_path / "given", recipe=recipe(max_len=1024), measure_only=True
    )
    assert given["recipe"]["max_len"] == 1024 and given["baseline"]["shortened"] == 12


def test_a_round_given_last_nights_out_moves_that_round_aside(corpus, raw_student, tmp_path):
    out = tmp_path / "r"
    first = night(corpus, raw_student, out)
    (out / "notes.txt").write_text("the owner's")
    # Tonight carries on from last night's adapter, in last night's OUT.
    second = night(corpus, raw_student, out, adapter=str(out / "best"))
    aside = out / "earlier" / first["round"]
    assert json.loads((aside / "round.json").read_text())["round"] == first["round"]
    assert (aside / "best" / "adapter_config.json").is_file() and (aside / "recipe.json").is_file()
    assert json.loads((out / "round.json").read_text())["round"] == second["round"]
    assert second["round"] != first["round"] and (out / "best" / "adapter_config.json").is_file()
    assert (out / "notes.txt").read_text() == "the owner's"  # not a round's: left where it was
    assert second["status"] == "done" and second["start"] == start_name(str(aside / "best"))
