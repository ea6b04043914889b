"""Rounds against a real hub on 127.0.0.1 (up, down, restarted, stopping them) on real Ray."""

import io
import json
import subprocess
import sys
import tarfile
import threading
import time

import pytest
import requests
from hubutil import HubProcess, free_port

pytestmark = pytest.mark.slow


@pytest.fixture
def hub(tmp_path, corpus):
    h = HubProcess(tmp_path / "hub")
    from gbray.hub.store import Store

    Store(h.db).load(corpus / "train.jsonl", corpus / "eval.jsonl")
    h.start()
    yield h
    h.stop()


def quick_recipe(**kw):
    from gbray.settings import Recipe

    base = dict(
        hours=0.4 / 60,
        epochs=5,
        turns=200,
        lr=3e-3,
        batch=4,
        accum=1,
        lora_r=8,
        lora_alpha=16,
        max_len=512,
        val_turns=16,
        val_every_minutes=0.1,
        last_every_minutes=0.1,
        progress_every_minutes=0.05,
        exam_turns=20,
        answer_budget=24,
        seed=5,
        gradient_checkpointing=False,
    )
    base.update(kw)
    return Recipe(**base)


def settings(hub_url, token, corpus, student, out, **kw):
    from gbray.settings import RoundSettings

    recipe = kw.pop("recipe", quick_recipe())
    return RoundSettings(
        data=corpus, model=str(student), out=out, hub=hub_url, token=token, recipe=recipe, **kw
    )


def get(hub, path):
    return requests.get(hub.url + path, headers=hub.headers("owner"), timeout=30)


def test_round_through_the_hub_is_live_and_stored(ray_local, hub, corpus, raw_student, tmp_path):
    from gbray.round import run_round, run_trial

    seen_live = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            rounds = get(hub, "/v1/training/state").json()["rounds"]
            if rounds and rounds[0]["status"] == "running":
                notes = get(hub, f"/v1/training/rounds/{rounds[0]['id']}").json()["notes"]
                if notes:
                    seen_live.append(len(notes))
            time.sleep(0.5)

    watcher = threading.Thread(target=watch)
    watcher.start()
    # Validation stalls from its second check on (kept by loss, which must fall by 1e9 to count):
    # a plateau early in the night, whatever the agreement does.
    stalls = quick_recipe(patience=1, min_gain=1e9, patience_after=0.0, keep_by="loss")
    try:
        record = run_round(
            settings(hub.url, hub.device, corpus, raw_student, tmp_path / "r", recipe=stalls)
        )
    finally:
        done.set()
        watcher.join()
    assert seen_live, "no progress line reached the hub while the round ran"
    rid = record["hub_round"]
    stored = get(hub, f"/v1/training/rounds/{rid}").json()
    assert stored["status"] == "done"
    assert stored["baseline"] == record["baseline"]["agreement_pct"]
    assert stored["result"] == record["result"]["agreement_pct"]
    assert stored["checks"] and all(c["valLoss"] is not None for c in stored["checks"])
    # The plateau did not end the night at its peak rate: it cooled down first, as round.json
    # and the hub's curve both show, each check with its phase, rate, loss and agreement.
    assert record["why"] == "plateau" and record["schedule"]["cooldown_why"] == "plateau"
    assert record["training_minutes"] < 0.4
    phases = [c["phase"] for c in record["checks"]]
    assert phases[-1] == "cool-down" and "stable" in phases[: phases.index("cool-down")]
    assert [c["phase"] for c in stored["checks"]] == phases
    # The raw student may learn a tool's name within a few steps, so agreement is compared with
    # round.json's, not with zero.
    assert [c["valAgreement"] for c in stored["checks"]] == [
        c["agreement"] for c in record["checks"]
    ]
    assert all(c["lr"] > 0 for c in stored["checks"])
    assert stored["checks"][-1]["lr"] < max(c["lr"] for c in stored["checks"]) / 2
    assert stored["end_body"]["perTool"]
    # Registered the field's way: base is the student's model id, the start is in the recipe.
    assert stored["base"] == record["student_name"] and stored["recipe"]["start"] == "bare"
    assert stored["end_body"]["result"]["agreement_pct"] == record["result"]["agreement_pct"]
    assert stored["end_body"]["result"]["turns"] == 20
    assert get(hub, f"/v1/training/adapters/{rid}-last").status_code == 200
    # The adapter fetched and extracted the field's way loads from the extracted folder itself.
    tgz = get(hub, f"/v1/training/adapters/{rid}")
    assert tgz.status_code == 200
    folder = tmp_path / "field-extracted"
    with tarfile.open(fileobj=io.BytesIO(tgz.content), mode="r:gz") as tar:
        tar.extractall(folder, filter="data")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(raw_student), str(folder)
    )
    assert any("lora_" in n for n, _ in loaded.named_parameters())
    assert get(hub, "/v1/training/state").json()["coverage"]["trained"] == record["turns_trained"]
    # The baseline is now cached: a trial of the same start reads nothing new, and takes no turns.
    handed = get(hub, "/v1/training/state").json()["coverage"]["handed_out"]
    trial = run_trial(
        settings(hub.url, hub.device, None, raw_student, tmp_path / "t", adapter=f"hub:{rid}")
    )
    assert trial["result"]["turns"] == 20 and trial["candidate"] == f"hub:{rid}"
    state = get(hub, "/v1/training/state").json()
    assert state["coverage"]["handed_out"] == handed
    # The trial is a round on the hub: registered, its notes streamed, ended done, trained 0.
    on_hub = get(hub, f"/v1/training/rounds/{trial['hub_round']}").json()
    assert on_hub["status"] == "done" and on_hub["trained"] == 0 and on_hub["recipe"]["trial"]
    assert on_hub["result"] == trial["result"]["agreement_pct"] and on_hub["baseline"] is None
    assert any("trial exam" in n["line"] for n in on_hub["notes"])


def test_round_with_the_hub_down_throughout(ray_local, corpus, raw_student, tmp_path):
    from gbray.round import run_round

    dead = f"http://127.0.0.1:{free_port()}"
    short = quick_recipe(hours=0.2 / 60)
    record = run_round(settings(dead, "t", corpus, raw_student, tmp_path / "r", recipe=short))
    assert record["status"] == "done" and record["hub_round"] is None
    assert record["baseline"] and record["result"]
    on_disk = json.loads((tmp_path / "r" / "round.json").read_text())
    assert (
        on_disk["status"] == "done" and (tmp_path / "r" / "best" / "adapter_config.json").is_file()
    )


def test_notes_kept_while_the_hub_is_down_arrive_in_order(
    ray_local, hub, corpus, raw_student, tmp_path
):
    from gbray.round import run_round

    out = tmp_path / "r"
    result = {}
    runner = threading.Thread(
        target=lambda: result.update(
            record=run_round(
                settings(
                    hub.url,
                    hub.device,
                    corpus,
                    raw_student,
                    out,
                    recipe=quick_recipe(hours=0.5 / 60),
                )
            )
        )
    )
    runner.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        rounds = get(hub, "/v1/training/state").json()["rounds"]
        if rounds and get(hub, f"/v1/training/rounds/{rounds[0]['id']}").json()["notes"]:
            break
        time.sleep(0.2)
    hub.stop()
    time.sleep(12)
    hub.start()
    runner.join(timeout=300)
    record = result["record"]
    notes = [
        n["line"] for n in get(hub, f"/v1/training/rounds/{record['hub_round']}").json()["notes"]
    ]
    progress = (out / "progress.log").read_text().splitlines()
    assert len(progress) > 5
    # Every line the trainer and examiners reported reached the hub, in the order they were made
    # (a subsequence: the hub also holds the driver's own notes; alike lines recur).
    remaining = iter(notes)
    missing = [line for line in progress if not any(line == note for note in remaining)]
    assert not missing, missing[:3]
    assert record["hub_ended"]


def test_two_rounds_one_baseline(ray_local, hub, corpus, raw_student, tmp_path):
    from gbray.round import run_round

    records = {}

    def one(name):
        records[name] = run_round(
            settings(
                hub.url,
                hub.device,
                corpus,
                raw_student,
                tmp_path / name,
                device_name=name,
                recipe=quick_recipe(threads=1, hours=0.3 / 60),
            )
        )

    threads = [threading.Thread(target=one, args=(n,)) for n in ("dev-a", "dev-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=400)
    measured = [n for n, r in records.items() if (r["baseline"] or {}).get("source") == "exam"]
    assert len(measured) == 1, {n: r["baseline"] for n, r in records.items()}
    other = next(n for n in records if n not in measured)
    assert records[other]["baseline"]["source"] == "hub"
    assert records[other]["baseline"]["by"] == measured[0]
    assert (
        records[other]["baseline"]["agreement_pct"]
        == records[measured[0]]["baseline"]["agreement_pct"]
    )
    assert len(records[other]["exam_pids"]) == 1  # only its result exam


def cli_round(hub, corpus, student, out, *flags):
    """`gbray round` against the hub in a subprocess, as a device runs it."""
    command = [sys.executable, "-m", "gbray.cli", "round", "--data", str(corpus), "--model",
               str(student), "--out", str(out), "--hub", hub.url, "--token", hub.device, *flags]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_note(hub, proc, words: str, within: float = 240) -> str:
    """The id of the running round whose notes say `words`; a round that exits first fails the
    test with its stderr."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the round exited ({proc.returncode}) first: {proc.stderr.read()[-2000:]}")
        for r in get(hub, "/v1/training/state").json()["rounds"]:
            notes = get(hub, f"/v1/training/rounds/{r['id']}").json()["notes"]
            if r["status"] == "running" and any(words in n["line"] for n in notes):
                return r["id"]
        time.sleep(0.5)
    pytest.fail(f"no note saying {words!r} within {within:.0f} s")


def test_stop_during_an_exam(hub, corpus, raw_student, tmp_path):
    out = tmp_path / "r"
    proc = cli_round(
        hub,
        corpus,
        raw_student,
        out,
        "--hours",
        "0.01",
        "--exam-turns",
        "150",
        "--exam-batch",
        "2",
        "--answer-budget",
        "320",
        "--max-len",
        "768",
        "--threads",
        "2",
    )
    rid = wait_for_note(hub, proc, "baseline exam")
    time.sleep(3)  # well inside the exam: 150 turns of 320 tokens from an untrained student
    asked = time.monotonic()
    assert requests.post(
        f"{hub.url}/v1/training/rounds/{rid}/stop", headers=hub.headers("owner"), timeout=10
    ).ok
    stdout, stderr = proc.communicate(timeout=120)
    took = time.monotonic() - asked
    assert proc.returncode == 0, stderr[-2000:]
    print(f"stop took {took:.1f} s")
    assert took < 15, took
    record = json.loads((out / "round.json").read_text())
    assert record["status"] == "stopped" and "baseline exam" in record["why"]
    assert record["baseline"] is None
    assert json.loads(stdout.strip().splitlines()[-1])["status"] == "stopped"
    assert get(hub, f"/v1/training/rounds/{rid}").json()["status"] == "stopped"


def fresh_adapter(student, out):
    """A freshly wrapped LoRA saved as a PEFT folder: a start to carry on from."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(student),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    model.save_pretrained(out)
    return out


FIELD_FLAGS = {
    "--hours": "0.004",
    "--eval-turns": "12",
    "--max-len": "384",
    "--batch": "2",
    "--lr": "0.002",
    "--epochs": "2",
    "--accum": "2",
    "--warmup": "0.1",
    "--lora-r": "4",
    "--lora-alpha": "8",
    "--lora-scope": "attn",
    "--slice": "40",
    "--validate-every": "0.05",
    "--validate-turns": "8",
    "--patience": "2",
    "--seed": "17",
    "--threads": "1",
}
# What each flag must have become in recipe.json.
FIELD_RECIPE = {
    "hours": 0.004,
    "exam_turns": 12,
    "max_len": 384,
    "batch": 2,
    "lr": 0.002,
    "epochs": 2.0,
    "accum": 2,
    "warmup": 0.1,
    "lora_r": 4,
    "lora_alpha": 8,
    "lora_scope": "attn",
    "precision": "bfloat16",
    "device": "cpu",
    "turns": 40,
    "val_every_minutes": 0.05,
    "val_turns": 8,
    "patience": 2,
    "seed": 17,
    "threads": 1,
}


def field_command(hub, corpus, student, adapter, out, last_flag):
    """The old script's command line, every flag of it."""
    flags = [x for kv in FIELD_FLAGS.items() for x in kv]
    return [
        sys.executable,
        "-m",
        "gbray.cli",
        "round",
        "--data",
        str(corpus),
        "--out",
        str(out),
        "--model",
        str(student),
        "--adapter",
        str(adapter),
        *flags,
        "--bf16",
        "--cpu",
        "--no-fetch",
        "--hub",
        hub.url,
        "--token",
        hub.device,
        "--device-name",
        "field-pc",
        last_flag,
    ]


@pytest.mark.parametrize("last_flag", ["--skip-baseline", "--measure-only"])
def test_a_field_command_line_reaches_the_recipe(hub, corpus, raw_student, tmp_path, last_flag):
    adapter = fresh_adapter(raw_student, tmp_path / "start")
    handed = get(hub, "/v1/training/state").json()["coverage"]["handed_out"]
    out = tmp_path / "r"
    run = subprocess.run(
        field_command(hub, corpus, raw_student, adapter, out, last_flag),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    recipe = json.loads((out / "recipe.json").read_text())
    for name, value in FIELD_RECIPE.items():
        assert recipe[name] == value, (name, recipe[name], value)
    record = json.loads((out / "round.json").read_text())
    assert record["carried_from"] == str(adapter) and record["start"].startswith("local:")
    assert record["status"] == "done" and record["paper"]["turns"] == 12
    on_hub = get(hub, f"/v1/training/rounds/{record['hub_round']}").json()
    assert on_hub["device"] == "field-pc" and on_hub["status"] == "done"
    # --no-fetch: the work came from --data; the hub handed out nothing.
    assert get(hub, "/v1/training/state").json()["coverage"]["handed_out"] == handed
    assert record["paper"]["scope"].startswith("local:")
    if last_flag == "--skip-baseline":
        assert record["baseline"] is None and record["result"]["turns"] == 12
        assert record["slice_turns"] <= 40 and record["steps"] >= 1
        assert len(record["exam_pids"]) == 1
    else:
        assert record["result"] is None and record["baseline"]["turns"] == 12
        assert "steps" not in record and on_hub["trained"] == 0
        assert on_hub["baseline"] == record["baseline"]["agreement_pct"]


def test_stop_during_training(hub, corpus, raw_student, tmp_path):
    out = tmp_path / "r"
    proc = cli_round(
        hub,
        corpus,
        raw_student,
        out,
        "--hours",
        "1",
        "--skip-baseline",
        "--val-every-minutes",
        "0.05",
        "--slice",
        "400",
        "--max-len",
        "512",
        "--threads",
        "2",
    )
    # Stopped once a validation has kept an adapter: that adapter stays, nothing more is made.
    rid = wait_for_note(hub, proc, "(kept)")
    asked = time.monotonic()
    assert requests.post(
        f"{hub.url}/v1/training/rounds/{rid}/stop", headers=hub.headers("owner"), timeout=10
    ).ok
    stdout, stderr = proc.communicate(timeout=120)
    took = time.monotonic() - asked
    assert proc.returncode == 0, stderr[-2000:]
    print(f"stop took {took:.1f} s")
    assert took < 15, took
    record = json.loads((out / "round.json").read_text())
    assert record["status"] == "stopped" and "training" in record["why"]
    assert record["result"] is None and "exam_pids" not in record
    on_hub = get(hub, f"/v1/training/rounds/{rid}").json()
    assert on_hub["status"] == "stopped"
    # Nothing more was trained, validated or uploaded after the stop; the adapter kept before
    # it is on disk and named in round.json.
    assert get(hub, f"/v1/training/adapters/{rid}").status_code == 404
    kept = record["kept"]
    assert kept["adapter"] == str(out / "best") and kept["step"] >= 1
    assert (out / "best" / "adapter_model.safetensors").is_file()
    # (A later check than the hub has seen may have been kept just before the stop.)
    checks = get(hub, f"/v1/training/rounds/{rid}").json()["checks"]
    assert kept["step"] >= min(c["step"] for c in checks if c["best"])
    assert kept["val_agreement"] is not None


def test_a_trial_of_a_candidate_that_cannot_load_ends_failed_on_the_hub(
    ray_local, hub, corpus, raw_student, tmp_path
):
    from gbray.round import run_trial

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"peft_type": "LORA", "r": "not a rank"}')
    (broken / "adapter_model.safetensors").write_bytes(b"not weights")
    trial = run_trial(
        settings(hub.url, hub.device, corpus, raw_student, tmp_path / "t", adapter=str(broken))
    )
    assert trial["status"] == "failed" and trial["result"] is None
    on_hub = get(hub, f"/v1/training/rounds/{trial['hub_round']}").json()
    assert on_hub["status"] == "failed" and on_hub["result"] is None
    assert on_hub["why"].startswith("trial of local:") and "failed" in on_hub["why"]
    assert len(on_hub["why"]) > len("trial of local:x failed: ")  # the reason is in it


def test_a_tls_hub_serves_a_round_to_a_device_given_its_ca_and_no_token_to_one_without(
    ray_local, corpus, raw_student, tmp_path, caplog
):
    import trustme

    from gbray.round import run_round

    authority = trustme.CA()
    served = authority.issue_cert("127.0.0.1")
    served.cert_chain_pems[0].write_to_path(tmp_path / "hub.pem")
    served.private_key_pem.write_to_path(tmp_path / "hub.key")
    authority.cert_pem.write_to_path(tmp_path / "ca.pem")
    hub = HubProcess(
        tmp_path / "hub", "--ssl-certfile", str(tmp_path / "hub.pem"),
        "--ssl-keyfile", str(tmp_path / "hub.key"),
    )  # fmt: skip
    from gbray.hub.store import Store

    Store(hub.db).load(corpus / "train.jsonl", corpus / "eval.jsonl")
    hub.url, hub.verify = hub.url.replace("http://", "https://"), str(tmp_path / "ca.pem")
    hub.start()
    try:
        trusted = run_round(
            settings(hub.url, hub.device, corpus, raw_student, tmp_path / "r",
                     ca=tmp_path / "ca.pem", recipe=quick_recipe(hours=0.2 / 60))
        )  # fmt: skip
        # Without the CA the hub cannot be verified: the device says so, sends no token, and
        # its night (here a measuring one) ends on its own --data.
        alone = run_round(
            settings(hub.url, hub.device, corpus, raw_student, tmp_path / "m", measure_only=True)
        )
        rounds = requests.get(
            hub.url + "/v1/training/state", headers=hub.headers("owner"), timeout=30,
            verify=hub.verify,
        ).json()["rounds"]  # fmt: skip
        # The client itself: one line says why, and nothing is retried (no 15-minute wait).
        from gbray.hub.client import ClientSettings, HubClient

        client = HubClient(ClientSettings(url=hub.url, token=hub.device))
        began = time.monotonic()
        with caplog.at_level("WARNING", logger="gbray.hub.client"):
            assert client.register("bare", 10, {}) is None
            assert client.slice(10) is None and client.paper(10) is None
            client.round_id = "r-any"
            assert client.end({"status": "done"}) is False
        assert time.monotonic() - began < 10
        said = [r.getMessage() for r in caplog.records if r.name == "gbray.hub.client"]
        assert len(said) == 1 and "cannot verify the hub" in said[0] and hub.device not in said[0]
    finally:
        hub.stop()
    assert trusted["status"] == "done" and trusted["hub_round"]
    assert [r["id"] for r in rounds] == [trusted["hub_round"]]
    assert rounds[0]["status"] == "done"
    assert alone["status"] == "done" and alone["hub_round"] is None
    assert alone["baseline"]["turns"] == 20
    # One registration reached the hub: the trusted device's.
    log = (tmp_path / "hub" / "hub.log").read_text()
    assert log.count('"POST /v1/training/rounds HTTP/1.1"') == 1, log[-3000:]
