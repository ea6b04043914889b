"""Shares and merge on real Ray clusters of several nodes (`ray.cluster_utils.Cluster`, each node
with its own custom resource), and trainers that die and come back. Slow: each test starts its
own cluster."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).parent.parent / "examples"


def cluster(*kinds, head_cpus=1):
    """A simulated cluster: a head and one node per kind, 1 CPU each, each with its resource."""
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": head_cpus,
            "resources": {"head": 1},
            "include_dashboard": False,
        },
    )
    nodes = {kind: c.add_node(num_cpus=1, resources={kind: 1}) for kind in kinds}
    c.wait_for_nodes()
    return c, nodes


def quick(**kw):
    from gbray.settings import Recipe

    base = dict(
        hours=1.2 / 60, epochs=3, turns=240, lr=3e-3, batch=4, accum=1, lora_r=8, lora_alpha=16,
        max_len=384, val_turns=16, val_every_minutes=0.25, last_every_minutes=0.1,
        progress_every_minutes=0.1, exam_turns=40, answer_budget=24, seed=5, threads=1,
        gradient_checkpointing=False, precision="float32",
    )  # fmt: skip
    base.update(kw)
    return Recipe(**base)


def test_a_two_share_round_from_one_command_on_three_nodes_through_a_hub(learnable, tmp_path):
    from hubutil import HubProcess

    from gbray.hub.store import Store

    corpus, student = learnable
    hub = HubProcess(tmp_path / "hub")
    Store(hub.db).load(corpus / "train.jsonl", corpus / "eval.jsonl")
    hub.start()
    c, _ = cluster("laptop", "desktop")
    out = tmp_path / "night"
    # The owner's driver script (examples/shares_night.py, on gbray.api): the shares night, the
    # owner's promotion of the merge, then a trial of what serves (a fresh exam in a process of
    # its own, nothing cached) that must score what its round recorded.
    recipe = {
        "epochs": 4, "turns": 1600, "lr": 3e-3, "batch": 8, "accum": 1, "lora_r": 16,
        "lora_alpha": 32, "max_len": 512, "val_every_minutes": 0.5, "exam_turns": 100,
        "answer_budget": 24, "seed": 5, "threads": 1, "gradient_checkpointing": False,
        # Pinned: where bfloat16 and float32 run the tiny student at about one speed (this
        # machine: 1.2x either way), each share's probe could choose differently.
        "precision": "float32",
    }  # fmt: skip
    try:
        run = subprocess.run(
            [
                sys.executable, str(EXAMPLES / "shares_night.py"), "--address", c.address,
                "--shares", "2", "--hub", hub.url, "--device-token", hub.device,
                "--owner-token", hub.owner, "--data", str(corpus), "--model", str(student),
                "--out", str(out), "--hours", "0.03", "--recipe", json.dumps(recipe),
            ],
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr[-3000:]
        said = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
        record = json.loads((out / "round.json").read_text())
        through_the_hub(hub, record)
    finally:
        c.shutdown()
        hub.stop()
    assert said[1] == {"promoted": True, "refused": None}
    tried = json.loads((out / "trial" / "trial.json").read_text())
    assert tried["candidate"] == f"hub:{record['hub_round']}"
    assert tried["serving"]["round"] == record["hub_round"]
    assert tried["result"]["turns"] == record["result"]["turns"] == 100
    assert abs(tried["result"]["right"] - record["result"]["right"]) <= 1, (tried, record["result"])
    reports = record["share_reports"]
    assert len(reports) == 2 and not record["lost_shares"]
    assert reports[0]["node"] != reports[1]["node"], "both shares ran on one node"
    assert record["packed"] is None
    # The shares synced while they trained: the merge is the averager's global adapter, and
    # round.json lists every sync with the turns behind it and the weight it was applied with.
    merge = record["merge"]
    assert merge["method"] == "outer" and record["adapter"] == merge["folder"]
    assert {s["share"] for s in merge["syncs"]} == {0, 1}
    assert all(s["turns"] > 0 and s["weight"] > 0 for s in merge["syncs"])
    assert sorted(m["share"] for m in merge["members"]) == [0, 1]  # in the order they joined
    assert sum(record["share_split"]) == record["slice_turns"]
    # One baseline for the shares (measured beside them: the cluster had a free node), one
    # result exam of the merge, and each share's own adapter on the same paper.
    assert record["baseline"]["turns"] == record["result"]["turns"] == 100
    shares = [r["exam"]["agreement_pct"] for r in reports]
    merged = record["result"]["agreement_pct"]
    baseline = record["baseline"]["agreement_pct"]
    # The shares sync every few seconds while they train (a fortieth of the budget), so the
    # merge has learned from both halves and scores at least as well as the weaker share, give or
    # take two turns of the paper. Not their mean: two adapters that synced every 4.5 s differ by
    # up to 14 turns on this 100-turn paper (CI: merge 55, shares 54 and 68; earlier 53 vs 53 and
    # 56), so one night's mean is mostly the exam's noise. Whether the merge beats the best share
    # is asked over seeds by benchmarks/shares_scaling.py.
    assert all(r["training"]["averaged"] >= 5 for r in reports), reports
    assert record["share_average_seconds"] == pytest.approx(0.03 * 3600 / 40)
    # The night is bound by its minutes, so what it learns follows the host's speed: the merge
    # scored 55 on an AVX-512 host, 26 on a 2-core AVX2-only one (shares 26 and 27, baseline 8),
    # where a bar of +20 failed. The owner's promotion above already needed the merge to score
    # above its baseline on the same paper; this asks for a clear margin on top.
    assert merged > baseline + 10, (merged, shares, baseline)
    assert merged >= min(shares) - 2, (merged, shares, baseline)
    assert "baseline exam beside the shares" in (out / "progress.log").read_text() or any(
        "beside the shares" in line for line in run.stderr.splitlines()
    )


def through_the_hub(hub, record: dict) -> None:
    """Each share is a round of its own on the hub, with its notes and curve, shown beside the
    merge round, which names them; the merge serves (the owner promoted it: it beat its
    baseline)."""
    import requests

    def get(path):
        r = requests.get(hub.url + path, headers=hub.headers("owner"), timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    merge = record["hub_round"]
    shares = [r["hub_round"] for r in record["share_reports"]]
    assert merge and all(shares) and len(set(shares)) == 2
    rows = {r["id"]: r for r in get("/v1/training/state")["rounds"]}
    assert rows[merge]["merge_of"] == 2 and rows[merge]["status"] == "done"
    for i, rid in enumerate(shares):
        assert (rows[rid]["share"], rows[rid]["share_of"]) == (i, merge)
        stored = get(f"/v1/training/rounds/{rid}")
        assert stored["status"] == "done" and stored["notes"] and stored["checks"]
    assert get(f"/v1/training/rounds/{merge}")["end_body"]["shares"] == shares
    assert get("/v1/training/state")["serving"]["round"] == merge  # the owner promoted it


def test_a_slow_share_syncs_less_and_does_not_hold_the_fast_one_back(learnable, tmp_path):
    import ray

    corpus, student = learnable
    from gbray.round import run_round
    from gbray.settings import RoundSettings

    # Four one-CPU machines: two for the shares night, two for the night without the slow
    # share, run side by side.
    c, _ = cluster("laptop", "desktop", "laptop-2", "desktop-2", head_cpus=0)
    # 0.4 s a turn (a sleep: no CPU taken): at least twice a turn's own time on the machines
    # seen (0.04 to 0.2 s on a one-CPU node).
    slow = {"runtime_env": {"env_vars": {"GBRAY_SIMULATED_SLOWDOWN": "0.4"}}}
    # Time-bound 42-second nights (more epochs than that allows), with and without the slow share.
    # Syncs every 6 s: a sync's fixed cost (~0.15 s here) is then the few percent it is in a real
    # night (every 2 minutes); the default for so short a night (every second) would cost 15%.
    night = quick(hours=0.7 / 60, epochs=50, turns=240, val_every_minutes=0.3)

    def night_of_two(name, every_minutes):
        return run_round(
            RoundSettings(
                data=corpus, model=str(student), out=tmp_path / name, shares=2,
                share_options=({}, slow), skip_baseline=True, recipe=night,
                share_average_minutes=every_minutes,
            )
        )  # fmt: skip

    try:
        ray.init(address=c.address)
        # The night without it: two more machines of the same kinds, each training its own part
        # and never syncing (they meet only in the merge), so its fast share's night has nothing
        # of the slow one in it. It runs at the same time as the shares night: this host drifts
        # (two such nights one after the other trained 440 then 348 turn-passes), and side by
        # side both nights see the same host, the same drift and the same load.
        with ThreadPoolExecutor(2) as pool:
            apart, both = (
                pool.submit(night_of_two, "apart", 0),
                pool.submit(night_of_two, "both", 0.1),
            )
            apart, both = apart.result(timeout=600), both.result(timeout=600)
    finally:
        ray.shutdown()
        c.shutdown()
    without = apart["share_reports"][0]["training"]["turn_passes"]
    fast, slower = both["share_reports"]
    speeds = fast["probe_turns_per_hour"], slower["probe_turns_per_hour"]
    assert speeds[0] > 2 * speeds[1], speeds
    # The parts follow the measured speeds; the shares end together and cool down together.
    split = both["share_split"]
    assert abs(split[0] / sum(split) - speeds[0] / sum(speeds)) < 0.05, (split, speeds)
    minutes = [r["training"]["training_minutes"] for r in (fast, slower)]
    assert abs(minutes[0] - minutes[1]) <= 0.3 + 0.1, minutes  # one validation interval
    began = [r["training"]["schedule"]["cooldown_began_minute"] for r in (fast, slower)]
    assert all(b is not None for b in began) and abs(began[0] - began[1]) <= 0.3 + 0.1, began
    # Nobody waits: the fast share trains what it trains in the night without it, within 10%
    # (issue 18). Side by side it measured 0.973 to 0.996 of it here (four runs, 644 to 738
    # turn-passes); nights one after the other differed by up to 20% on an AVX2-only host. A
    # fast share that waited for the slow one would go at its pace, a quarter.
    passes = fast["training"]["turn_passes"]
    print(f"fast share: {passes} turn-passes; without the slow share: {without}")
    assert abs(passes - without) <= 0.1 * without, (passes, without)
    # What it spent syncing is in its report, a small part of its night.
    assert 0 < fast["training"]["sync_minutes"] < 0.1 * fast["training"]["training_minutes"]
    # Syncs come every so many turns, so the slow share syncs less often; each sync counts the
    # turns behind it, and every turn a share trained is in its syncs (the last when it left).
    merge = both["merge"]
    syncs = {i: [x for x in merge["syncs"] if x["share"] == i] for i in (0, 1)}
    assert len(syncs[1]) < len(syncs[0]) / 1.5, (len(syncs[0]), len(syncs[1]))
    assert all(x["turns"] >= merge["every_turns"] for x in syncs[1] if not x["final"])
    members = {m["share"]: m for m in merge["members"]}
    for i, report in enumerate((fast, slower)):
        assert members[i]["turns_synced"] == report["training"]["turn_passes"]
    # The slow share counts by its speed: while both sync, a movement's weight is 1 / (1 + its
    # relative speed), above the 1/2 of two equal shares (1 once the other has left). Its own
    # movements are stale (the fast share brought many times its turns since it was handed the
    # global) and count in proportion: their freshness, which their weight includes. How stale
    # follows the two machines' speed ratio, so the host's: 2/k where the fast share synced k
    # times in between (k = 4, freshness 0.5, on a 2-core AVX2-only host; a larger k on faster ones).
    fresh = [x["weight"] for x in merge["syncs"] if x["freshness"] == 1]
    assert all(0.5 < w <= 1.0 for w in fresh) and min(fresh) < 0.95, merge["syncs"]
    assert min(x["freshness"] for x in syncs[1]) < 1, syncs[1]
    print("the slow share's syncs:", syncs[1])
    assert all(x["weight"] <= 1.0 * x["freshness"] + 1e-4 for x in merge["syncs"])


def test_a_machine_that_joins_mid_night_gets_a_share_of_its_own(learnable, tmp_path):
    import ray

    corpus, student = learnable
    from gbray.round import run_round
    from gbray.settings import RoundSettings

    c, _ = cluster("laptop", "desktop", head_cpus=0)
    out = tmp_path / "r"
    result = {}
    try:
        ray.init(address=c.address)
        settings = RoundSettings(
            data=corpus, model=str(student), out=out, shares=2, share_joins=True,
            skip_baseline=True, recipe=quick(hours=1.0 / 60, epochs=50, turns=240),
        )  # fmt: skip
        runner = threading.Thread(
            target=lambda: result.update(record=run_round(settings)), daemon=True
        )
        runner.start()
        deadline = time.monotonic() + 300
        logs = [out / f"share-{i}" / "progress.log" for i in range(2)]
        while time.monotonic() < deadline and not all(
            p.is_file() and "synced with the other shares" in p.read_text() for p in logs
        ):
            time.sleep(0.5)
        late = c.add_node(num_cpus=1, resources={"late": 1})
        runner.join(timeout=600)
    finally:
        ray.shutdown()
        c.shutdown()
    record = result["record"]
    assert record["status"] == "done", record.get("why")
    assert [j["share"] for j in record["joins"]] == [2]
    joined = record["joins"][0]
    assert joined["node"] == late.node_id and joined["minute"] > 0
    # It trained the turns kept back, from the current average, and its syncs are in the result.
    assert sum(record["share_split"]) + joined["turns"] == record["slice_turns"]
    report = record["share_reports"][2]
    assert report["training"]["turn_passes"] > 0 and report["joined_minute"] == joined["minute"]
    members = {m["share"]: m for m in record["merge"]["members"]}
    assert members[2]["turns_synced"] == report["training"]["turn_passes"]
    assert members[2]["joined_minute"] > members[0]["joined_minute"]


def test_a_trainer_killed_with_sigkill_resumes_from_its_checkpoint(raw_student, corpus, tmp_path):
    import ray
    import torch

    from gbray.actors import TrainerActor
    from gbray.data.turns import index_folder
    from gbray.settings import as_record
    from gbray.trainer import RESUME_FILE, optimizer_digest

    ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        train, _ = index_folder(corpus)
        turns = train.read(list(range(200)))
        # 90 steps: the first checkpoint comes at about step 14, and the rest runs after the restart.
        recipe = quick(hours=10 / 60, epochs=2, last_every_minutes=0.05, val_every_minutes=5)
        out = tmp_path / "t"
        trainer = TrainerActor.options(num_cpus=1).remote(
            str(raw_student), None, as_record(recipe), str(out), str(tmp_path / "p.log"), None,
            "bare", "run-1",
        )  # fmt: skip
        pid = ray.get(trainer.pid.remote())
        ref = trainer.train.remote(turns[:180], turns[180:])
        checkpoint = out / "last" / RESUME_FILE
        deadline = time.monotonic() + 120
        while not checkpoint.is_file() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        saved = torch.load(checkpoint, weights_only=False)  # the dead process wrote its last
        # Ray restarts the actor and runs the train call again; it carries on from the checkpoint.
        deadline = time.monotonic() + 120
        resumed = None
        while resumed is None and time.monotonic() < deadline:
            try:
                resumed = ray.get(trainer.resumed.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - the actor is restarting
                time.sleep(0.5)
            time.sleep(0.2)
        assert resumed is not None, "the restarted trainer did not resume"
        assert ray.get(trainer.pid.remote()) != pid
        assert resumed["step"] == saved["state"]["steps"]
        expected = _digest_of_saved(saved["optimizer"], optimizer_digest)
        assert resumed["optimizer"] == expected
        summary = ray.get(ref, timeout=900)
        assert summary.resumed_from_step == saved["state"]["steps"]
        assert summary.steps > saved["state"]["steps"]
    finally:
        ray.shutdown()


def _digest_of_saved(state_dict, digest):
    """The digest of a saved optimizer state, computed the way the trainer computes its own."""

    class Saved:
        def state_dict(self):
            return state_dict

    return digest(Saved())


def test_the_fields_merge_syntax_merges_trains_nothing_and_examines_once(
    raw_student, corpus, tmp_path
):
    import ray
    from test_merge import share

    from gbray.round import run_round
    from gbray.settings import RoundSettings

    folders = [share(raw_student, tmp_path / f"a{i}", seed=i) for i in range(2)]
    ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        record = run_round(
            RoundSettings(
                data=corpus, model=str(raw_student), out=tmp_path / "r",
                adapter="merge:" + ",".join(str(f) for f in folders), recipe=quick(exam_turns=12),
            )
        )  # fmt: skip
    finally:
        ray.shutdown()
    assert record["status"] == "done" and record["merge"]["method"] == "fedavg"
    assert record["slice_turns"] == 0 and "steps" not in record and "trainer_pid" not in record
    assert len(record["exam_pids"]) == 2  # the shares' baseline and the merge's result
    assert record["start"] == "bare" and record["baseline"]["turns"] == 12
    assert (tmp_path / "r" / "merged" / "adapter_config.json").is_file()


def test_an_exam_whose_machine_goes_away_is_asked_again_on_a_live_one(learnable, tmp_path):
    """The failure behind a lost node's round: the result exam scheduled onto a machine that is
    gone but not yet known dead. The examiner starts again elsewhere; the exam still answers."""
    import ray

    from gbray.actors import ExaminerActor
    from gbray.data.turns import index_folder
    from gbray.settings import ExamMode
    from gbray.work import paper_of

    corpus, student = learnable
    _, evaluation = index_folder(corpus)
    paper, _ = paper_of(evaluation, 200)
    c, nodes = cluster("laptop", "desktop", head_cpus=0)
    try:
        ray.init(address=c.address)
        recipe = quick()
        examiner = ExaminerActor.options(num_cpus=1).remote(
            str(student), None, recipe.precision, 1, "cpu", str(tmp_path / "progress.log")
        )
        first_pid, where = ray.get([examiner.pid.remote(), examiner.node.remote()])
        exam = examiner.exam.remote(paper, recipe.answer_budget, recipe.max_len, ExamMode(4))
        lost = next(n for n in nodes.values() if n.node_id == where)
        c.remove_node(lost, allow_graceful=False)
        result = ray.get(exam, timeout=300)
        again = ray.get(examiner.pid.remote())
        survivor = next(n for n in nodes.values() if n is not lost)
    finally:
        ray.shutdown()
        c.shutdown()
    assert result.turns == len(paper)
    assert result.pid == again != first_pid
    assert survivor.node_id != where
