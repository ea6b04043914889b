"""Nights one after another on one hub (SPEC §12): each starts from what serves (`hub:serving`),
the hub promotes by itself (`--auto-promote`), and its gate keeps a night from trading a tool
away. Real hub processes on 127.0.0.1, real rounds on real Ray."""

import json
import shutil
import subprocess
import sys

import pytest
import requests
from hubutil import HubProcess

from gbray.data.turns import tool_of_raw_line

pytestmark = pytest.mark.slow


def drop_tool(data, tool):
    """The corpus's training turns, in place, less every turn of `tool`; the paper is the same."""
    lines = (data / "train.jsonl").read_bytes().splitlines(keepends=True)
    kept = [line for line in lines if tool_of_raw_line(line) != tool]
    assert len(kept) < len(lines)
    (data / "train.jsonl").write_bytes(b"".join(kept))


def state(hub):
    return requests.get(
        hub.url + "/v1/training/state", headers=hub.headers("owner"), timeout=30
    ).json()


def night_recipe(minutes, **kw):
    """Bound by its turns (1.5 epochs of 480: 90 steps), with `minutes` only as a cap, so a
    slower machine trains the same night, only later."""
    from gbray.settings import Recipe

    base = dict(
        hours=minutes / 60, epochs=1.5, turns=480, lr=2e-3, batch=8, accum=1, lora_r=16,
        lora_alpha=32, max_len=512, val_turns=16, val_every_minutes=0.2, exam_turns=150,
        answer_budget=24, seed=3, progress_every_minutes=0.2, gradient_checkpointing=False,
    )  # fmt: skip
    base.update(kw)
    return Recipe(**base)


def test_a_night_that_loses_a_tool_is_refused_by_the_fallen_tool_rule(
    ray_local, learnable, tmp_path
):
    from gbray.api import RoundSettings, night

    learned, student = learnable
    # A copy: the second night's slice loses a tool. One folder for both nights, so both sit
    # one paper in one scope (a baseline's key), as two nights from one hub do.
    data = shutil.copytree(learned, tmp_path / "data")
    hub = HubProcess(tmp_path / "hub", "--auto-promote").start()
    try:
        first = night(
            RoundSettings(
                data=data, model=str(student), out=tmp_path / "n1", hub=hub.url,
                token=hub.device, adapter="hub:serving", recipe=night_recipe(4),
            )
        )  # fmt: skip
        served = state(hub)["serving"]
        assert first.status == "done" and served and served["round"] == first.hub_round, (
            first.baseline_pct, first.result_pct, state(hub)["decisions"],
        )  # fmt: skip
        # The tool what serves knows best (most turns right on the paper) is left out of the
        # next night's slice.
        rows = first.record["result"]["per_tool"]
        lost = max(rows, key=lambda t: (rows[t]["right"], t))
        assert rows[lost]["right"] >= 8, rows
        drop_tool(data, lost)
        second = night(
            RoundSettings(
                data=data, model=str(student), out=tmp_path / "n2", hub=hub.url,
                token=hub.device, adapter="hub:serving", recipe=night_recipe(6, lr=4e-3, epochs=3),
            )
        )  # fmt: skip
        assert second.status == "done" and second.start == f"hub:{first.hub_round}"
        # A score belongs to the adapter: the first night's result, told to the hub with its
        # per-tool counts, is the second's baseline, not examined again, and the rule below
        # judges the fall from it.
        assert second.record["baseline"]["source"] == "hub", second.record["baseline"]
        told, measured = second.record["baseline"], first.record["result"]
        assert (told["marks"], told["per_tool"]) == (measured["marks"], measured["per_tool"])
        assert len(second.record["exam_pids"]) == 1
        seen = state(hub)
        decision = next(d for d in seen["decisions"] if d["round"] == second.hub_round)
        after = second.record["result"]["per_tool"].get(lost)
        assert not decision["promoted"], (decision, after)
        # The slice never held the tool, so the rule judged it with the paper's other such
        # tools, as one group, and names it.
        rules = [part.split(":")[0] for part in decision["why"].split("; ")]
        assert rules == ["no fallen tool"], decision["why"]
        assert "(new tools) [" in decision["why"] and lost in decision["why"], decision["why"]
        assert lost in second.record["new_tools"]["tools"]
        assert seen["serving"]["round"] == first.hub_round  # what serves did not change
    finally:
        hub.stop()


def gbray(*args, timeout=900):
    done = subprocess.run(
        [sys.executable, "-m", "gbray.cli", *map(str, args)], capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.week
def test_three_nights_from_what_serves_raise_it(tmp_path):
    """Three 3-minute nights of the tiny student on `gbray synth --wording alt` (a 150-turn
    paper), each `--adapter hub:serving`, through `gbray hub serve --auto-promote`; then a trial
    of what serves in a process of its own. About 11 minutes: `-m week`, not in `.ci/run`."""
    data, student = tmp_path / "data", tmp_path / "student"
    gbray("synth", "--wording", "alt", "--turns", 8000, "--seed", 5, "--out", data)
    gbray("student", "--data", data, "--out", student, "--pretrain-steps", 450, "--seed", 0)
    hub = HubProcess(tmp_path / "hub", "--auto-promote")
    gbray(
        "hub",
        "load",
        "--db",
        hub.db,
        "--train",
        data / "train.jsonl",
        "--eval",
        data / "eval.jsonl",
    )
    hub.start()
    served_after, nights = [], []
    try:
        common = ["--data", data, "--model", student, "--hub", hub.url, "--token", hub.device,
                  "--adapter", "hub:serving", "--threads", 1, "--exam-turns", 150]  # fmt: skip
        for k in range(1, 4):
            out = tmp_path / f"night-{k}"
            gbray("round", *common, "--out", out, "--hours", 3 / 60, "--seed", k)
            nights.append(json.loads((out / "round.json").read_text()))
            served_after.append(state(hub)["serving"])
        trial = tmp_path / "trial"
        gbray("trial", "--model", student, "--hub", hub.url, "--token", hub.device,
              "--adapter", "hub:serving", "--threads", 1, "--exam-turns", 150, "--out", trial)  # fmt: skip
        tried = json.loads((trial / "trial.json").read_text())
    finally:
        hub.stop()
    assert [n["status"] for n in nights] == ["done"] * 3
    assert all(n["start"] == "bare" or n["start"].startswith("hub:") for n in nights)
    assert served_after[0] is not None, nights[0]["result"]
    first, last = served_after[0]["result"], served_after[2]["result"]
    assert last >= first + 5, [s and s["result"] for s in served_after]
    # What serves scores what its round recorded, measured again in another process and with
    # nothing cached: a score belongs to the adapter.
    assert tried["serving"]["round"] == served_after[2]["round"]
    recorded = next(n for n in nights if n["hub_round"] == served_after[2]["round"])
    assert abs(tried["result"]["right"] - recorded["result"]["right"]) <= 1, (tried, recorded)
