"""A whole round on real Ray, on a corpus of other tools and lengths than the defaults, with a
briefly pre-trained tiny student. Slow: about four minutes."""

import json
import shutil
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow

# Two and a half minutes: at a minute and a half an AVX2-only 2-core CPU took 110 steps, still
# inside the student's flat start, and the win was clear once (p = 0.036) and once not
# (8 -> 17 of 100, p = 0.108).
BUDGET_MINUTES = 2.5


@pytest.fixture(scope="module")
def with_bad_lines(learnable, tmp_path_factory):
    """The shared learnable corpus (copied: a bad line of each kind is added, counted and never
    fatal) and its student."""
    data, student = learnable
    root = tmp_path_factory.mktemp("with-bad-lines")
    shutil.copytree(data, root / "data")
    with open(root / "data" / "train.jsonl", "a") as f:
        f.write('not json at all\n{"job": "x", "messages": []}\n')
    (root / "student").symlink_to(student)
    return root


@pytest.fixture(scope="module")
def finished_round(ray_local, with_bad_lines):
    from gbray.round import run_round
    from gbray.settings import Recipe, RoundSettings

    recipe = Recipe(
        hours=BUDGET_MINUTES / 60,
        epochs=10,
        turns=2000,
        lr=1e-3,
        batch=8,
        accum=1,
        lora_r=32,
        lora_alpha=64,
        max_len=768,
        val_every_minutes=0.4,
        exam_turns=100,
        seed=3,
        progress_every_minutes=0.5,
        gradient_checkpointing=False,
    )
    out = with_bad_lines / "round"
    started = time.monotonic()
    record = run_round(
        RoundSettings(
            data=with_bad_lines / "data",
            model=str(with_bad_lines / "student"),
            out=out,
            recipe=recipe,
        )
    )
    return record, out, time.monotonic() - started


def test_round_json_is_complete(finished_round):
    record, out, _ = finished_round
    on_disk = json.loads((out / "round.json").read_text())
    assert on_disk["round"] == record["round"]
    for key in (
        "round",
        "device",
        "student",
        "carried_from",
        "draw_seed",
        "recipe",
        "steps",
        "best_val_loss",
        "best_step",
        "turns_trained",
        "training_minutes",
        "why",
        "mean_loss",
        "baseline",
        "result",
        "adapter",
        "beat",
        "trainer_pid",
        "exam_pids",
        "driver",
        "trainer_process",
        "paper",
    ):
        assert key in on_disk, key
    assert on_disk["status"] == "done"
    assert on_disk["bad_lines"]["train"]["total"] == 2
    assert on_disk["result"]["per_tool"] and on_disk["baseline"]["per_tool"]
    assert on_disk["paper"]["turns"] == 100
    recipe = json.loads((out / "recipe.json").read_text())
    assert recipe["lr"] == 1e-3 and "student.json" in recipe["why"]["lr"]
    # The corpus's turns share their system prompt: every step ran it once.
    assert on_disk["choices"]["share_prefix"] is True
    assert (
        on_disk["steps"] - 1 <= on_disk["shared_prefix_steps"] <= on_disk["steps"]
    )  # a last lone turn: whole
    assert 0 < on_disk["spared_tokens_share"] < 1


def test_round_json_shows_the_schedule_and_every_validation(finished_round):
    record, _, _ = finished_round
    # Ten epochs planned, two and a half minutes given: the cool-down began by the clock, with a fifth of
    # the night left, and the night ended cooled down.
    assert record["schedule"]["kind"] == "wsd" and record["schedule"]["cooldown_why"] == "time"
    assert record["schedule"]["cooldown_began_minute"] == pytest.approx(
        0.8 * BUDGET_MINUTES, abs=0.1
    )
    checks = record["checks"]
    assert {"step", "phase", "lr", "loss", "agreement", "kept"} <= set(checks[0])
    assert checks[-1]["phase"] == "cool-down" and checks[-1]["step"] == record["steps"]
    assert [c["phase"] for c in checks].count("stable") >= 2
    # The adapter kept is the last check that was kept when it was made.
    kept = [c for c in checks if c["kept"]][-1]
    assert kept["step"] == record["best_step"]
    assert kept["agreement"] == record["best_val_agreement"]


def test_result_beats_baseline_on_a_corpus_of_other_tools(finished_round):
    record, _, _ = finished_round
    assert record["beat"], (record["baseline"]["agreement_pct"], record["result"]["agreement_pct"])
    assert record["result"]["agreement_pct"] > record["baseline"]["agreement_pct"]


def test_exams_run_in_their_own_processes_and_end(finished_round):
    record, _, _ = finished_round
    assert len(record["exam_pids"]) == 2
    assert record["trainer_pid"] not in record["exam_pids"]
    assert len(set(record["exam_pids"])) == 2
    deadline = time.monotonic() + 20
    while any(psutil.pid_exists(p) for p in record["exam_pids"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(psutil.pid_exists(p) for p in record["exam_pids"]), (
        "an examiner outlived its exam"
    )


def test_short_budget_stops_on_time_then_examines(finished_round):
    record, _, _ = finished_round
    assert record["why"] == "time"  # ten epochs planned, two and a half minutes given
    assert record["epochs_done"] < 10
    # Within one optimizer step plus one validation (each well under ten seconds here).
    assert record["training_minutes"] <= BUDGET_MINUTES + 10 / 60
    assert record["result"] is not None


def test_adapter_is_peft_format_and_loads(finished_round):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    record, _, _ = finished_round
    adapter = Path(record["adapter"])
    assert (adapter / "adapter_config.json").is_file() and (
        adapter / "adapter_model.safetensors"
    ).is_file()
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(record["student"]), str(adapter)
    )
    assert any("lora_" in n for n, _ in model.named_parameters())


def test_process_record_holds_no_secrets(finished_round):
    record, _, _ = finished_round
    for proc in (record["driver"], record["trainer_process"]):
        assert proc["interpreter"] and proc["pid"]
        assert not [k for k in proc["environment"] if "TOKEN" in k.upper() or "KEY" in k.upper()]
        assert "PATH" in proc["environment"]  # the record is not simply empty
    assert "must-not-leak" not in json.dumps(record)


def test_round_json_pairs_the_baseline_with_the_result(finished_round):
    from gbray.paired import mcnemar_p

    record, _, _ = finished_round
    before, after = record["baseline"], record["result"]
    assert len(before["marks"]) == len(after["marks"]) == after["turns"]
    assert after["marks"].count("1") == after["right"]
    paired = record["comparison"]["paired"]
    assert paired["only_after"] - paired["only_before"] == after["right"] - before["right"]
    assert sum(paired[k] for k in ("only_after", "only_before", "both", "neither")) == 100
    assert paired["p_value"] == mcnemar_p(paired["only_after"], paired["only_before"])
    # A win on 100 turns that the hub's gate would take (p < 0.05): the night is time-bound, so
    # how clear it is follows the machine (see BUDGET_MINUTES).
    assert paired["p_value"] < 0.05, paired
    rows = record["comparison"]["per_tool"]
    assert sum(row["asked"] for row in rows.values()) == 100
    assert isinstance(record["comparison"]["fell"], list)
    # The fast exam: the prefix was shared and answers ended at their tool.
    assert after["prefix_tokens"] > 16 and after["stop_at_tool"] is True
    assert after["generated_tokens"] < 100 * 320
