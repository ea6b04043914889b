"""The promotion gate on a real hub (`gbray hub serve --promote-p 0.05 --refuse-fallen`): a round
is held to its own baseline, to what serves on the same paper, to significance from the per-turn
marks, and to no fallen tool; a refusal names its rule. The rules alone, without a server, too."""

import random

import pytest
import requests
from hubutil import HubProcess

from gbray.hub.gate import Candidate, GateRules, Serving, refusal

TURNS = 150


def marks(right: int, turns: int = TURNS, seed: int = 0, keep: str | None = None) -> str:
    """`right` turns right out of `turns`; with `keep`, the turns right there stay right (the
    new model keeps what the start had and adds more)."""
    rng = random.Random(seed)
    if keep is not None:
        have = [i for i, m in enumerate(keep) if m == "1"]
        rest = [i for i, m in enumerate(keep) if m == "0"]
        chosen = set(have[:right]) | set(rng.sample(rest, max(0, right - len(have))))
    else:
        chosen = set(rng.sample(range(turns), right))
    return "".join("1" if i in chosen else "0" for i in range(turns))


def exam(m: str) -> dict:
    return {"agreement_pct": round(100 * m.count("1") / len(m), 2), "turns": len(m), "marks": m}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    h = HubProcess(tmp_path_factory.mktemp("gate"), "--promote-p", "0.05", "--refuse-fallen")
    h.start()
    yield h
    h.stop()


def call(hub, method, path, token, **kw):
    headers = {"Authorization": f"Bearer {token}"}
    return requests.request(method, hub.url + path, headers=headers, timeout=30, **kw)


def night(hub, before: str, after: str, paper: str, per_tool=None, recipe=None,
          new_tools=None) -> str:  # fmt: skip
    """A device's round, ended with these exams and an adapter uploaded."""
    from test_field import field_adapter

    rid = call(
        hub, "POST", "/v1/training/rounds", hub.device,
        json={"device": "laptop", "base": "m", "turns": 10, "recipe": recipe or {"start": "bare"}},
    ).json()["id"]  # fmt: skip
    body = {"status": "done", "baseline": exam(before), "result": exam(after), "paper": paper}
    if per_tool:
        body["perTool"] = per_tool
    if new_tools:
        body["newTools"] = new_tools
    assert call(hub, "POST", f"/v1/training/rounds/{rid}/end", hub.device, json=body).ok
    assert call(hub, "PUT", f"/v1/training/rounds/{rid}/adapter", hub.device,
                data=field_adapter()).ok  # fmt: skip
    return rid


def promote(hub, rid):
    return call(hub, "POST", f"/v1/training/rounds/{rid}/promote", hub.owner)


def test_the_gate_on_a_real_hub(hub):
    start = marks(45)
    # Won by one turn in 150: beat its baseline, but no significance.
    by_one = night(hub, start, marks(46, keep=start), "p-A")
    r = promote(hub, by_one)
    assert r.status_code == 409 and r.json()["detail"].startswith("significance:"), r.text
    assert "1 turns only the new adapter got right, 0 only the start" in r.json()["detail"]
    # Its paired counts as the hub computes them, for the page.
    stored = call(hub, "GET", f"/v1/training/rounds/{by_one}", hub.owner).json()
    assert stored["paired"]["only_after"] == 1 and stored["paired"]["p_value"] == 1.0
    # A clear win is promoted.
    clear = night(hub, start, marks(90, keep=start), "p-A")
    assert promote(hub, clear).status_code == 200
    assert call(hub, "GET", "/v1/training/serving", hub.device).json()["serving"]["round"] == clear
    # Beat its own baseline, significantly, but not what serves on the same paper.
    under = night(hub, marks(10, seed=2), marks(70, seed=3), "p-A")
    r = promote(hub, under)
    assert r.status_code == 409 and r.json()["detail"].startswith("above what serves:"), r.text
    assert f"round {clear}: 60.0" in r.json()["detail"]
    # On another paper what serves has no score: refused, saying how to get one.
    other = night(hub, marks(10, seed=4), marks(80, seed=5), "p-B")
    r = promote(hub, other)
    assert r.status_code == 409 and "has no score on paper p-B" in r.json()["detail"], r.text
    assert f"gbray trial --adapter hub:{clear}" in r.json()["detail"]
    # A trial of what serves on p-B gives it a score there; now `other` is held to it and wins.
    trial = call(
        hub, "POST", "/v1/training/rounds", hub.device,
        json={"device": "laptop", "base": "m", "turns": 0,
              "recipe": {"start": f"hub:{clear}", "trial": True}},
    ).json()["id"]  # fmt: skip
    end = {"status": "done", "baseline": None, "result": exam(marks(30, seed=6)), "paper": "p-B"}
    assert call(hub, "POST", f"/v1/training/rounds/{trial}/end", hub.device, json=end).ok
    # A tool that collapsed refuses a round that otherwise wins everything.
    fell = night(
        hub, marks(10, seed=7), marks(85, seed=8), "p-B",
        per_tool={"open": {"asked": 20, "before": "18/20", "after": "2/20"},
                  "click": {"asked": 20, "before": "5/20", "after": "19/20"}},
    )  # fmt: skip
    r = promote(hub, fell)
    assert r.status_code == 409 and r.json()["detail"].startswith("no fallen tool:"), r.text
    assert "open 18/20 -> 2/20" in r.json()["detail"]
    # Tools the round's slice never held are judged as one group: three, each asked 4 times
    # (too rarely alone), together 12/12 -> 2/12.
    rare = {t: {"asked": 4, "before": "4/4", "after": a} for t, a in
            (("zoom", "1/4"), ("share", "1/4"), ("cite", "0/4"))}  # fmt: skip
    grouped = night(
        hub, marks(10, seed=9), marks(90, seed=10), "p-B", per_tool=rare,
        new_tools={"tools": sorted(rare), "asked": 12, "before": 12, "after": 2,
                   "before_pct": 100.0, "after_pct": 16.67},
    )  # fmt: skip
    r = promote(hub, grouped)
    assert (
        r.status_code == 409
        and "(new tools) [cite, share, zoom] 12/12 -> 2/12" in r.json()["detail"]
    ), r.text
    stored = call(hub, "GET", f"/v1/training/rounds/{grouped}", hub.owner).json()
    assert stored["end_body"]["newTools"]["after_pct"] == 16.67
    assert promote(hub, other).status_code == 200
    assert call(hub, "GET", "/v1/training/serving", hub.device).json()["serving"]["round"] == other
    # The state lists each round's p-value (computed by the hub from the marks).
    rows = {r["id"]: r for r in call(hub, "GET", "/v1/training/state", hub.owner).json()["rounds"]}
    assert rows[by_one]["p_value"] == 1.0 and rows[clear]["p_value"] < 1e-6
    assert rows[trial]["p_value"] is None


def candidate(baseline=20.0, result=40.0, body=None) -> Candidate:
    return Candidate("r-1", "done", True, "p-1", baseline, result, body or {})


def test_the_rules_alone():
    plain = GateRules()
    assert refusal(candidate(), None, plain) is None
    assert refusal(candidate(result=20.0), None, plain).startswith("beat its baseline:")
    assert refusal(candidate(), Serving("r-0", 40.0, "x"), plain).startswith("above what serves:")
    assert refusal(candidate(), Serving("r-0", 39.9, "x"), plain) is None
    # Re-promoting what serves is not held to itself.
    assert refusal(candidate(), Serving("r-1", 40.0, "x"), plain) is None
    strict = GateRules(promote_p=0.05)
    assert refusal(candidate(), None, strict).startswith("significance:")  # no marks: unknown
    # Every rule broken is named, in the gate's order: an owner sees a fallen tool even in a round
    # that also failed to beat what serves.
    fell = {"perTool": {"open": {"asked": 20, "before": "18/20", "after": "2/20"}}}
    both = refusal(candidate(body=fell), Serving("r-0", 40.0, "x"), GateRules(refuse_fallen=True))
    rules = [part.split(":")[0] for part in both.split("; ")]
    assert rules == ["above what serves", "no fallen tool"], both
    field_device = candidate(body={"baseline": {"agreement_pct": 20.0}, "result": {}})
    assert "no per-turn marks" in refusal(field_device, None, strict)
    with pytest.raises(ValueError):
        GateRules(promote_p=0).validate()


def test_an_unattended_hub_promotes_what_passes_its_gate_and_notes_every_refusal(
    tmp_path_factory,
):
    from test_field import field_adapter

    hub = HubProcess(tmp_path_factory.mktemp("auto"), "--auto-promote").start()
    try:
        start = marks(45)

        def serving():
            return call(hub, "GET", "/v1/training/serving", hub.device).json()["serving"]

        def notes(rid):
            stored = call(hub, "GET", f"/v1/training/rounds/{rid}", hub.owner).json()
            return [n["line"] for n in stored["notes"]]

        # The field's order (end, then the adapter): promoted once the adapter lands.
        clear = night(hub, start, marks(90, keep=start), "p-A")
        assert serving()["round"] == clear
        assert notes(clear) == ["hub: promoted automatically; it passed the gate and serves now"]
        # Won by one turn: --auto-promote requires significance by default, whatever the device
        # says of its own p-value or asks for.
        fake = {"pValue": 0.0001, "promote": True, "beat": True}
        served = marks(90, keep=start)
        by_one = night(hub, served, marks(91, keep=served), "p-A",
                       recipe={"start": f"hub:{clear}", **fake})  # fmt: skip
        assert serving()["round"] == clear
        assert notes(by_one)[-1].startswith("hub: not promoted: significance:"), notes(by_one)
        # A tool that fell, in a round that otherwise wins: refused by default too.
        fell = night(
            hub, marks(10, seed=7), marks(140, seed=8), "p-A",
            per_tool={"open": {"asked": 20, "before": "18/20", "after": "2/20"}},
        )  # fmt: skip
        assert notes(fell)[-1].startswith("hub: not promoted: no fallen tool:"), notes(fell)
        assert serving()["round"] == clear
        # gbray's order (the adapter, then the end), clearly above what serves: promoted.
        rid = call(
            hub, "POST", "/v1/training/rounds", hub.device,
            json={"device": "laptop", "base": "m", "turns": 10, "recipe": {"start": "bare"}},
        ).json()["id"]  # fmt: skip
        assert call(hub, "PUT", f"/v1/training/rounds/{rid}/adapter", hub.device,
                    data=field_adapter()).ok  # fmt: skip
        assert serving()["round"] == clear  # not ended yet: not a candidate
        better = marks(140, keep=served)
        end = {"status": "done", "baseline": exam(start), "result": exam(better), "paper": "p-A"}
        assert call(hub, "POST", f"/v1/training/rounds/{rid}/end", hub.device, json=end).ok
        assert serving()["round"] == rid
        # The same end again is a retry: no second decision.
        assert call(hub, "POST", f"/v1/training/rounds/{rid}/end", hub.device, json=end).ok
        # A trial is not a candidate; every decision is in the history, oldest first.
        state = call(hub, "GET", "/v1/training/state", hub.owner).json()
        assert [(d["round"], d["promoted"], d["by"]) for d in state["decisions"]] == [
            (clear, True, "auto"), (by_one, False, "auto"), (fell, False, "auto"),
            (rid, True, "auto"),
        ]  # fmt: skip
        assert state["decisions"][1]["why"].startswith("significance:")
    finally:
        hub.stop()
