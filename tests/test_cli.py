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


def test_the_fields_environment_names_the_hub_token_and_device(raw_student, tmp_path, monkeypatch):
    from gbray.cli import _round_settings, build_parser

    monkeypatch.setenv("GB_HUB", "http://hub.example:8600")
    monkeypatch.setenv("GB_TOKEN", "field-token")
    monkeypatch.delenv("GB_DEVICE", raising=False)
    monkeypatch.setenv("COMPUTERNAME", "FIELD-PC")
    argv = ["round", "--model", str(raw_student), "--out", str(tmp_path / "o")]
    settings = _round_settings(build_parser().parse_args(argv))
    assert (settings.hub, settings.token, settings.device_name) == (
        "http://hub.example:8600",
        "field-token",
        "FIELD-PC",
    )
    monkeypatch.setenv("GB_DEVICE", "field-laptop")
    assert _round_settings(build_parser().parse_args(argv)).device_name == "field-laptop"
    flags = [*argv, "--hub", "http://other:1", "--token", "t2", "--device-name", "d2"]
    settings = _round_settings(build_parser().parse_args(flags))
    assert (settings.hub, settings.token, settings.device_name) == ("http://other:1", "t2", "d2")


def test_help_shows_one_entry_per_setting():
    out = run("round", "--help")
    assert out.returncode == 0
    entries = [line.split()[0] for line in out.stdout.splitlines() if line.startswith("  --")]
    assert len(entries) == len(set(entries))
    text = out.stdout
    for both in (
        "--precision PRECISION, --bf16",
        "--device DEVICE, --cpu",
        "--turns TURNS, --slice",
    ):
        assert both in text, both
    assert "--exam-turns EXAM_TURNS, --eval-turns EXAM_TURNS" in text
    assert "--fetch, --no-fetch" in text


def test_a_trial_takes_only_the_flags_it_reads():
    """A trial trains nothing: a round's training, shares and gate flags are refused, not
    accepted and ignored; every setting it does read is a flag."""
    from gbray.cli import TRIAL_EXAM_SETTINGS, TRIAL_SETTINGS

    out = run("trial", "--help")
    assert out.returncode == 0
    entries = {line.split()[0].rstrip(",") for line in out.stdout.splitlines()
               if line.startswith("  --")}  # fmt: skip
    wanted = {"--" + name.replace("_", "-") for name in TRIAL_SETTINGS + TRIAL_EXAM_SETTINGS}
    assert entries == wanted, entries ^ wanted
    for flag, value in (("--shares", "2"), ("--hours", "1"), ("--lr", "1e-3"),
                        ("--fall-points", "5"), ("--skip-baseline", None)):  # fmt: skip
        refused = run("trial", "--out", "/nonexistent/t", flag, *([value] if value else []))
        assert refused.returncode == 2 and "unrecognized arguments" in refused.stderr, flag


@pytest.mark.parametrize(
    "flags", [["--minutes", "0"], ["--minutes", "-1"], ["--pretrain-steps", "-5"],
              ["--pretrain-seconds", "0"]],
)  # fmt: skip
def test_a_demo_given_a_bad_number_stops_before_it_writes_or_builds(tmp_path, flags):
    out = tmp_path / "demo"
    refused = run("demo", "--out", str(out), *flags, timeout=60)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert refused.stderr.strip().splitlines() == [f"gbray: error: {flags[0]} must be " + (
        ">= 0" if flags[0] == "--pretrain-steps" else "> 0")]  # fmt: skip
    assert not out.exists()


def test_an_adapter_folder_that_is_not_one_is_refused_before_ray(tmp_path, corpus, raw_student):
    (tmp_path / "empty").mkdir()
    for adapter in (str(tmp_path / "missing"), str(tmp_path / "empty"),
                    f"merge:hub:r1,{tmp_path / 'empty'}"):  # fmt: skip
        refused = run("round", "--data", str(corpus), "--model", str(raw_student),
                      "--out", str(tmp_path / "r"), "--adapter", adapter, "--hub", "http://h:1",
                      "--token", "t", timeout=60)  # fmt: skip
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
        line = refused.stderr.strip().splitlines()[-1]  # after the student's hints, logged
        assert "is not an adapter folder" in line and "hub:r1" not in line, line


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_cluster_or_hub_that_does_not_answer_is_one_line_and_exit_3(tmp_path, corpus,
                                                                       raw_student):  # fmt: skip
    """Ray's own connect retries an address where nothing listens for minutes; the round says
    so in seconds, before it starts anything."""
    dead = f"127.0.0.1:{free_port()}"
    refused = run("round", "--data", str(corpus), "--model", str(raw_student),
                  "--out", str(tmp_path / "r"), "--address", dead, "--hours", "0.01",
                  timeout=60)  # fmt: skip
    assert refused.returncode == 3 and "Traceback" not in refused.stderr, refused.stderr
    line = refused.stderr.strip().splitlines()[-1]
    assert f"no Ray cluster answers at --address {dead}" in line, line
    assert not (tmp_path / "r" / "round.json").exists()
    refused = run("hub", "promote", "r1", "--hub", f"http://{dead}", "--token", "t", timeout=60)
    assert refused.returncode == 3, refused.stderr[-2000:]
    assert refused.stderr.strip().splitlines() == [
        f"gbray: error: no hub answers at http://{dead}: ConnectionError"
    ]


def test_hub_administration_never_makes_a_hub_at_a_mistyped_path(tmp_path):
    db = tmp_path / "hub.dbb"
    for args in (("token", "add", "laptop"), ("token", "list"), ("token", "revoke", "laptop"),
                 ("marks", "clear")):  # fmt: skip
        refused = run("hub", *args, "--db", str(db), timeout=60)
        assert refused.returncode == 2, (args, refused.stderr[-2000:])
        assert refused.stderr.strip().splitlines() == [
            f"gbray: error: no hub database at {db} (`gbray hub serve --db` or `gbray hub load "
            "--db` makes one)"
        ]
        assert not db.exists() and refused.stdout == "", args
    refused = run(
        "hub", "serve", "--db", str(db), "--store", str(tmp_path / "s"), "--port", "65536"
    )
    assert refused.returncode == 2 and "65536 is not a port" in refused.stderr
    assert not db.exists()


def test_a_model_id_without_network_or_cache_is_one_line_before_ray(tmp_path, corpus):
    import time

    env = {
        **os.environ,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "1",  # the same answer as no network, without asking one
    }
    started = time.monotonic()
    out = subprocess.run(
        [*GBRAY, "round", "--data", str(corpus), "--out", str(tmp_path / "o"), "--hours", "0.01"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("gbray: error:")]
    assert len(errors) == 1 and "Qwen/Qwen2.5-0.5B-Instruct" in errors[0], out.stderr
    assert "no cached copy" in errors[0]
    assert "Ray" not in out.stderr and time.monotonic() - started < 30
    assert not (tmp_path / "o" / "round.json").exists()
