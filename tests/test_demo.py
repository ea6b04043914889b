"""`gbray demo` end to end, on its embedded defaults (the README's first command), and the round it
ran checked in full: a whole round on real Ray through a real hub, with a tiny student pre-trained
here, on a corpus of other tools and lengths than the defaults. The student is the session's
`learnable` one, built by the same code with the demo's settings into the session's student
cache, where the demo finds it (as a second run of the demo on one machine does). The slowest test
module (about three minutes): one demo serves every check."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo(tmp_path_factory, learnable):
    """The demo's stdout and the round.json it wrote. Secret-named variables are set in its
    environment, so the process records can be checked for leaving them out."""
    out = tmp_path_factory.mktemp("demo")
    env = {**os.environ, "GBRAY_TEST_SECRET_TOKEN": "must-not-leak"}
    env["GBRAY_TEST_API_KEY"] = "must-not-leak"
    done = subprocess.run(
        [sys.executable, "-m", "gbray.cli", "demo", "--out", str(out)],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # The session's student was the demo's own: not pre-trained a second time.
    assert "built by an earlier run, copied from" in done.stdout, done.stdout[:2000]
    record = json.loads((out / "round" / "round.json").read_text())
    return done.stdout, record, out / "round"


def budget_minutes() -> float:
    from gbray.cli import DEMO_RECIPE

    return DEMO_RECIPE.hours * 60


def test_the_demo_shows_a_clear_gain_before_and_after(demo):
    stdout, record, out = demo
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["beat"] and record["paper"]["turns"] >= 100
    assert record["result"]["agreement_pct"] - record["baseline"]["agreement_pct"] >= 20
    assert "must-not-leak" not in (out / "round.json").read_text()
    assert "before" in stdout and "after" in stdout
    # The demo's hub took the round and, asked by its owner, promoted it.
    assert "promotion of" in stdout and "HTTP 200" in stdout


def test_round_json_is_complete(demo):
    _, record, out = demo
    for key in (
        "round", "device", "student", "carried_from", "draw_seed", "recipe", "steps",
        "best_val_loss", "best_step", "turns_trained", "training_minutes", "why", "mean_loss",
        "baseline", "result", "adapter", "beat", "trainer_pid", "exam_pids", "driver",
        "trainer_process", "paper", "hub_round", "preparing_minutes",
    ):  # fmt: skip
        assert key in record, key
    assert record["status"] == "done"
    # Fitting 2,400 default turns takes a second or two, inside the training minutes.
    assert 0 < record["preparing_minutes"] < 0.1 * record["training_minutes"]
    assert record["bad_lines"] and all(seen["total"] == 0 for seen in record["bad_lines"].values())
    assert record["result"]["per_tool"] and record["baseline"]["per_tool"]
    recipe = json.loads((out / "recipe.json").read_text())
    assert recipe["hours"] == pytest.approx(budget_minutes() / 60) and recipe["why"]
    # The corpus's turns share their system prompt: every step ran it once (a last lone turn: whole).
    assert record["choices"]["share_prefix"] is True
    assert record["steps"] - 1 <= record["shared_prefix_steps"] <= record["steps"]
    assert 0 < record["spared_tokens_share"] < 1


def test_round_json_shows_the_schedule_and_every_validation(demo):
    _, record, _ = demo
    # More epochs planned than the minutes allow: the cool-down began by the clock, with a fifth
    # of the night left, and the night ended cooled down.
    assert record["schedule"]["kind"] == "wsd" and record["schedule"]["cooldown_why"] == "time"
    assert record["schedule"]["cooldown_began_minute"] == pytest.approx(
        0.8 * budget_minutes(), abs=0.1
    )
    checks = record["checks"]
    assert {"step", "phase", "lr", "loss", "agreement", "kept"} <= set(checks[0])
    assert checks[-1]["phase"] == "cool-down" and checks[-1]["step"] == record["steps"]
    assert [c["phase"] for c in checks].count("stable") >= 2
    # The adapter kept is the last check that was kept when it was made.
    kept = [c for c in checks if c["kept"]][-1]
    assert kept["step"] == record["best_step"]
    assert kept["agreement"] == record["best_val_agreement"]


def test_a_short_budget_stops_on_time_then_examines(demo):
    _, record, _ = demo
    assert record["why"] == "time" and record["epochs_done"] < record["recipe"]["epochs"]
    # Within one optimizer step plus one validation (each well under ten seconds here).
    assert record["training_minutes"] <= budget_minutes() + 10 / 60
    assert record["result"] is not None


def test_exams_run_in_their_own_processes_and_end(demo):
    _, record, _ = demo
    assert len(record["exam_pids"]) == 2
    assert record["trainer_pid"] not in record["exam_pids"]
    assert len(set(record["exam_pids"])) == 2
    deadline = time.monotonic() + 20
    while any(psutil.pid_exists(p) for p in record["exam_pids"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(psutil.pid_exists(p) for p in record["exam_pids"]), (
        "an examiner outlived its exam"
    )


def test_the_adapter_is_peft_format_and_loads(demo):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, record, _ = demo
    adapter = Path(record["adapter"])
    assert (adapter / "adapter_config.json").is_file()
    assert (adapter / "adapter_model.safetensors").is_file()
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(record["student"]), str(adapter)
    )
    assert any("lora_" in n for n, _ in model.named_parameters())


def test_process_records_hold_no_secrets(demo):
    _, record, _ = demo
    for proc in (record["driver"], record["trainer_process"]):
        assert proc["interpreter"] and proc["pid"]
        assert not [k for k in proc["environment"] if "TOKEN" in k.upper() or "KEY" in k.upper()]
        assert "PATH" in proc["environment"]  # the record is not simply empty
    assert "must-not-leak" not in json.dumps(record)


def test_round_json_pairs_the_baseline_with_the_result(demo):
    from gbray.paired import mcnemar_p

    _, record, _ = demo
    before, after = record["baseline"], record["result"]
    turns = record["paper"]["turns"]
    assert len(before["marks"]) == len(after["marks"]) == after["turns"] == turns
    assert after["marks"].count("1") == after["right"]
    paired = record["comparison"]["paired"]
    assert paired["only_after"] - paired["only_before"] == after["right"] - before["right"]
    assert sum(paired[k] for k in ("only_after", "only_before", "both", "neither")) == turns
    assert paired["p_value"] == mcnemar_p(paired["only_after"], paired["only_before"])
    assert paired["p_value"] < 0.05, paired  # a win the hub's gate would take
    rows = record["comparison"]["per_tool"]
    assert sum(row["asked"] for row in rows.values()) == turns
    assert isinstance(record["comparison"]["fell"], list)
    # The fast exam: the prefix was shared and answers ended at their tool.
    assert after["prefix_tokens"] > 16 and after["stop_at_tool"] is True
    assert after["generated_tokens"] < turns * record["recipe"]["answer_budget"]
