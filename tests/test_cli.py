import json
import os
import subprocess
import sys

import pytest

GBRAY = [sys.executable, "-m", "gbray.cli"]


def run(*args, timeout=120):
    env = {**os.environ, "GBRAY_TEST_SECRET_TOKEN": "must-not-leak"}
    return subprocess.run([*GBRAY, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_help_answers():
    out = run("round", "--help")
    assert out.returncode == 0
    for flag in ("--hours", "--epochs", "--lora-r", "--answer-budget", "--address", "--adapter"):
        assert flag in out.stdout


@pytest.mark.parametrize("case", ["missing", "empty", "unreadable", "no-eval"])
def test_bad_data_folder_is_one_line_and_non_zero(tmp_path, raw_student, case):
    data = tmp_path / "data"
    if case != "missing":
        data.mkdir()
    if case == "empty":
        (data / "train.jsonl").write_text("")
        (data / "eval.jsonl").write_text("")
    if case == "unreadable":
        (data / "train.jsonl").write_bytes(os.urandom(4096))
        (data / "eval.jsonl").mkdir()
    if case == "no-eval":
        (data / "train.jsonl").write_text("{}\n")
    out = run(
        "round",
        "--data",
        str(data),
        "--model",
        str(raw_student),
        "--out",
        str(tmp_path / "o"),
        "--hours",
        "0.01",
    )
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("gbray: error:")]
    assert len(errors) == 1, out.stderr


def test_synth_cuts_by_job(tmp_path):
    out = run(
        "synth",
        "--out",
        str(tmp_path),
        "--turns",
        "300",
        "--eval-turns",
        "60",
        "--prompt-tokens",
        "120",
    )
    assert out.returncode == 0, out.stderr
    jobs = {}
    for name in ("train", "eval"):
        rows = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        jobs[name] = {r["job"] for r in rows}
        assert len(rows) == (300 if name == "train" else 60)
        assert all(r["tier"] in ("gold", "silver") for r in rows)
    assert not jobs["train"] & jobs["eval"]


@pytest.mark.slow
def test_demo_end_to_end(tmp_path):
    out = run("demo", "--out", str(tmp_path), timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    record = json.loads((tmp_path / "round" / "round.json").read_text())
    assert summary["beat"] and record["paper"]["turns"] >= 100
    assert record["result"]["agreement_pct"] - record["baseline"]["agreement_pct"] >= 20
    assert "must-not-leak" not in (tmp_path / "round" / "round.json").read_text()
    assert "before" in out.stdout and "after" in out.stdout


def test_flags_win_over_student_hints_over_defaults(raw_student, tmp_path):
    from gbray.cli import _round_settings, build_parser

    args = build_parser().parse_args(
        [
            "round",
            "--data",
            str(tmp_path),
            "--model",
            str(raw_student),
            "--out",
            str(tmp_path / "o"),
            "--lr",
            "1e-3",
        ]
    )
    recipe = _round_settings(args).recipe
    assert recipe.lr == 1e-3  # the flag
    assert recipe.batch == 8 and recipe.accum == 1  # the tiny student's hints
    assert recipe.epochs == 3 and recipe.answer_budget == 320  # the SPEC defaults
