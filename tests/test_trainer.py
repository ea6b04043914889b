import json
from pathlib import Path

import pytest
import torch

from gbray.data.fit import IGNORE, make_example
from gbray.data.turns import index_folder
from gbray.schedule import Schedule
from gbray.settings import Recipe
from gbray.trainer import Trainer, TrainState, planned_steps


def recipe(**kw):
    base = dict(
        hours=1.0,
        epochs=1,
        lr=1e-3,
        batch=2,
        accum=2,
        lora_r=4,
        lora_alpha=8,
        max_len=256,
        answer_room=32,
        val_turns=8,
        val_every_minutes=0,
        val_every_steps=0,
        seed=1,
        device="cpu",
        threads=1,
        gradient_checkpointing=True,
        precision="float32",
        exam_turns=10,
        turns=20,
    )
    base.update(kw)
    return Recipe(**base)


def test_replan_ends_the_cosine_at_the_floor():
    r = recipe(lr=1e-3, min_lr_ratio=0.1, warmup=0.05)
    schedule = Schedule.new("cosine", r.lr, r.min_lr_ratio, r.warmup, 600, r.cooldown)
    assert (schedule.total, schedule.warmup) == (600, 30)
    lrs = []
    for step in range(120):
        lrs.append(schedule.rate(step, 0.0, 1.0))
        if step + 1 == 5:
            # 5 steps took 10 s each and 1150 s are left: 115 more fit, not 595.
            assert schedule.replan(5, 10.0, 1150.0)
            assert schedule.total == 120 and schedule.warmup == 6
            assert schedule.replanned_from == 600
    assert schedule.rate(120, 0.0, 1.0) == pytest.approx(r.lr * r.min_lr_ratio, rel=1e-6)
    assert max(lrs) == pytest.approx(r.lr, rel=0.02)  # it did leave its warm-up


def test_replan_never_goes_past_the_data_plan():
    r = recipe()
    schedule = Schedule.new("cosine", r.lr, r.min_lr_ratio, r.warmup, 50, r.cooldown)
    assert not schedule.replan(5, 1.0, 10_000.0)
    assert schedule.replan(5, 1.0, 20.0) and schedule.total == 25
    # Faster than the first estimate: it grows back, but never past the data's 50.
    assert schedule.replan(10, 1.0, 10_000.0) and schedule.total == 50


def test_planned_steps_counts_accumulation():
    assert planned_steps(100, recipe(batch=2, accum=4, epochs=3)) == 38


@pytest.fixture(scope="module")
def turns(corpus):
    train, _ = index_folder(corpus)
    return train.read(list(range(40)))


def test_nan_guard_skips_and_counts(raw_student, turns, tmp_path):
    trainer = Trainer(str(raw_student), None, recipe(), tmp_path)
    state = TrainState()
    good = make_example(trainer.tokenizer, turns[0], 256, 32)
    masked = make_example(trainer.tokenizer, turns[1], 256, 32)
    masked.labels = [IGNORE] * len(masked.labels)  # nothing labelled: the loss is 0/0
    assert trainer.micro_step([masked], state) is None
    assert state.skipped_nan == 1 and state.pending == 0
    assert trainer.micro_step([good], state) is not None
    trainer.optimizer_step(state, trainer.recipe.lr)
    lora = [p for n, p in trainer.model.named_parameters() if "lora_" in n]
    assert lora and all(torch.isfinite(p).all() for p in lora)
    assert any(p.abs().sum() > 0 for n, p in trainer.model.named_parameters() if "lora_B" in n)


def test_short_budget_stops_on_time_and_still_writes_adapters(raw_student, turns, tmp_path):
    # 6 seconds for a plan of many epochs: it stops on time, applies the leftover, validates once.
    trainer = Trainer(str(raw_student), None, recipe(hours=6 / 3600, epochs=50, accum=4), tmp_path)
    lines = []
    trainer.report = lines.append
    started = trainer.clock()
    summary = trainer.train(turns[:30], turns[30:38])
    took = trainer.clock() - started
    assert summary.why == "time"
    assert summary.turn_passes < 30 * 50
    assert took < 6 + 8  # one optimizer step plus one validation past the budget, with room
    assert summary.checks and summary.best_val_loss is not None
    for name in ("best", "last"):
        assert (Path(tmp_path) / name / "adapter_config.json").is_file()
        assert (Path(tmp_path) / name / "adapter_model.safetensors").is_file()
    assert any("turn-passes" in line for line in lines)
    assert summary.replanned_from is not None
    # The re-planned cosine ended at its floor: the steps it planned were taken, or the time
    # ran out within its last steps (a step or two short of a plan made from the first steps'
    # speed: within 5% of the floor).
    assert summary.final_lr <= 1e-3 * 0.1 * 1.05 or summary.steps >= summary.planned_steps


@pytest.mark.parametrize("after, why", [(0.0, "patience"), (0.5, "finished")])
def test_a_plateau_ends_a_cosine_night_only_once_its_share_of_the_hours_is_spent(
    raw_student, turns, tmp_path, after, why
):
    # Every check after the first is "without gain" (a gain must beat the best by 1e9), so one
    # such check is patience enough; an hour's budget is far from half spent in these seconds.
    trainer = Trainer(
        str(raw_student), None,
        recipe(accum=1, val_every_steps=1, patience=1, min_gain=1e9, patience_after=after,
               schedule="cosine"),
        tmp_path,
    )  # fmt: skip
    summary = trainer.train(turns[:12], turns[30:34])
    assert summary.why == why
    assert summary.steps == (2 if why == "patience" else 6)


def test_a_night_whose_validation_stalls_cools_down_before_it_ends(raw_student, turns, tmp_path):
    # Validation never gains after its first check (min_gain 1e9; the raw student names no
    # tool, so agreement ties): a plateau as soon as the warm-up is done, far from the end of
    # the data (40 epochs) and of the hour. The night cools down from there, then ends.
    r = recipe(accum=1, epochs=40, val_every_steps=1, patience=1, min_gain=1e9, patience_after=0)
    trainer = Trainer(str(raw_student), None, r, tmp_path)
    lines = []
    trainer.report = lines.append
    summary = trainer.train(turns[:12], turns[30:34])
    assert summary.why == "plateau"
    assert summary.schedule["cooldown_why"] == "plateau"
    assert summary.steps < summary.planned_steps  # it ended early, but only after cooling down
    phases = [c["phase"] for c in summary.checks]
    # A plateau counts only once the warm-up is done; the night ends cooled down.
    order = ["warm-up", "stable", "cool-down"]
    assert [order.index(p) for p in phases] == sorted(order.index(p) for p in phases)
    assert "stable" in phases and phases[-1] == "cool-down"
    cooling = [c["lr"] for c in summary.checks if c["phase"] == "cool-down"]
    # Falling to the floor (the last check's rate is the last step's, taken just before the
    # cool-down's end).
    assert cooling[0] < r.lr and r.lr * r.min_lr_ratio <= cooling[-1] < 0.3 * r.lr
    assert cooling == sorted(cooling, reverse=True)
    assert any(line.startswith("plateau:") for line in lines)


@pytest.mark.parametrize("keep_by, kept_step", [("agreement", 1), ("loss", 6)])
def test_the_kept_adapter_has_the_best_agreement_not_the_lowest_loss(
    raw_student, turns, tmp_path, keep_by, kept_step
):
    # Six checks, scripted where the two measures disagree: the first names 40 of 64 turns
    # right; the later ones have lower losses but name only 20 of those 40 (an adapter falling
    # towards one tool for everything), or the same 40 with a higher loss.
    right_40, right_20 = "1" * 40 + "0" * 24, "1" * 20 + "0" * 44
    script = iter([(0.50, right_40), (0.30, right_20), (0.60, right_40), (0.30, right_20),
                   (0.28, right_20), (0.25, right_20)])  # fmt: skip
    trainer = Trainer(
        str(raw_student), None,
        recipe(accum=1, val_every_steps=1, patience=100, keep_by=keep_by), tmp_path,
    )  # fmt: skip
    trainer.validation_scores = lambda examples: next(script)
    summary = trainer.train(turns[:12], turns[30:34])
    assert summary.steps == 6 and len(summary.checks) == 6
    assert summary.best_step == kept_step
    saved = json.loads((tmp_path / "best" / "trainer_state.json").read_text())
    assert saved["step"] == kept_step
    if keep_by == "agreement":
        assert summary.best_val_agreement == pytest.approx(62.5)
        assert summary.best_val_loss == 0.50
        assert [c["kept"] for c in summary.checks] == [True] + [False] * 5


def test_shares_of_one_night_cool_down_together_whatever_their_speed(raw_student, turns, tmp_path):
    # Two trainers of one night (one clock: the same wall-clock end), one slowed to a fraction
    # of the other's speed, with more epochs than either can train: both begin the cool-down
    # when a fifth of the night is left, within one of the slow trainer's steps. Validations
    # every 9 s: one that straddles the mark (at 12.8 s) delays the cool-down by its own time,
    # which on a slow host (AVX2-only, two trainers in one process) passed the bound below.
    import threading
    import time

    night = 16.0
    r = recipe(hours=night / 3600, epochs=200, accum=1, val_every_minutes=0.15)
    fast = Trainer(str(raw_student), None, r, tmp_path / "fast")
    # A pause of several times a turn's own time (0.05 to 0.15 s on the machines seen).
    pause = 0.4
    slow = Trainer(str(raw_student), None, r, tmp_path / "slow", pause_per_turn=pause)
    ends_at = time.time() + night
    done = {}

    def train(name, trainer):
        done[name] = trainer.train(turns[:12], turns[30:34], ends_at)

    runs = [threading.Thread(target=train, args=pair) for pair in (("fast", fast), ("slow", slow))]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    assert done["fast"].steps > 2 * done["slow"].steps
    began = []
    for summary in done.values():
        assert summary.why == "time" and summary.schedule["cooldown_why"] == "time"
        began.append(summary.schedule["cooldown_began_minute"] * 60)
        assert summary.checks[-1]["phase"] == "cool-down"
    # Two turns' pause and the step itself, with room; or, where the host was slower than that,
    # half again the slow trainer's mean step in this night (in CI on an AVX2-only host its step
    # took over 1.3 s, and the cool-down began 1.6 s after the mark).
    slowed = done["slow"]
    slow_step = max(2 * pause + 0.3, 1.5 * slowed.minutes * 60 / max(1, slowed.steps))
    rounding = 0.3  # round.json keeps the minute to two places
    assert all(abs(b - 0.8 * night) <= slow_step + rounding for b in began), began


def test_a_validation_that_crosses_the_cool_down_mark_starts_the_cool_down_at_once(
    raw_student, turns, tmp_path
):
    # On a clock of its own: every step takes a second and a validation eight. The one at step
    # 75 begins at 75 s and ends at 83 s, past the mark (80 s: a fifth of a 100-s night left),
    # so the cool-down begins at that step and the next step already takes its rate, not the
    # peak's.
    now = [0.0]
    r = recipe(hours=100 / 3600, epochs=200, accum=1, val_every_steps=75)
    trainer = Trainer(str(raw_student), None, r, tmp_path, clock=lambda: now[0])
    accumulate, optimizer_step, rates = trainer.accumulate, trainer.optimizer_step, []

    def a_second_a_step(micro_batches, state):
        accumulate(micro_batches, state)
        now[0] += 1.0

    def noting_the_rate(state, rate):
        rates.append(rate)
        optimizer_step(state, rate)

    def eight_seconds(examples):
        now[0] += 8.0
        return 0.5, "1" * len(examples)

    trainer.accumulate, trainer.optimizer_step = a_second_a_step, noting_the_rate
    trainer.validation_scores = eight_seconds
    summary = trainer.train(turns[:12], turns[30:34])
    assert summary.checks[0]["step"] == 75 and summary.checks[0]["minute"] * 60 < 80
    assert summary.schedule["cooldown_why"] == "time"
    assert summary.schedule["cooldown_began_step"] == 75
    assert summary.steps > 76 and rates[75] < rates[74] == r.lr


def test_the_hours_count_the_time_the_slice_took_to_prepare(raw_student, turns, tmp_path):
    # On a clock of its own: preparing the slice takes 40 s of a 100-s night and every step a
    # second, so 60 steps fit and the cool-down begins at 80 s of the night, 40 s into the steps.
    now = [0.0]
    r = recipe(hours=100 / 3600, epochs=200, accum=1, val_every_steps=1000)
    trainer = Trainer(str(raw_student), None, r, tmp_path, clock=lambda: now[0])
    accumulate, slice_examples = trainer.accumulate, trainer.slice_examples

    def a_second_a_step(micro_batches, state):
        accumulate(micro_batches, state)
        now[0] += 1.0

    def forty_seconds(slice_turns):
        now[0] += 40.0
        return slice_examples(slice_turns)

    trainer.accumulate, trainer.slice_examples = a_second_a_step, forty_seconds
    trainer.validation_scores = lambda examples: (0.5, "1" * len(examples))
    summary = trainer.train(turns[:12], turns[30:34])
    assert summary.why == "time" and 59 <= summary.steps <= 61, summary.steps
    assert summary.minutes == pytest.approx(100 / 60, abs=0.02)
    assert summary.schedule["cooldown_began_step"] == pytest.approx(40, abs=1)
    assert summary.preparing_minutes == pytest.approx(40 / 60, abs=0.001)


def test_a_schedule_free_night_keeps_the_optimizers_average(raw_student, turns, tmp_path):
    # Schedule-Free AdamW trains one sequence of weights (y) and keeps their average (x): the
    # validation and the adapter files are x, and training carries on from y.
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    r = recipe(accum=1, epochs=2, val_every_steps=4, schedule="schedule-free", lr=3e-3)
    trainer = Trainer(str(raw_student), None, r, tmp_path)
    summary = trainer.train(turns[:12], turns[30:34])
    assert summary.schedule["kind"] == "schedule-free" and summary.steps == 12
    trained = {k: v.clone() for k, v in get_peft_model_state_dict(trainer.model).items()}
    with trainer.kept_weights():
        kept = {k: v.clone() for k, v in get_peft_model_state_dict(trainer.model).items()}
    saved = load_file(str(tmp_path / "last" / "adapter_model.safetensors"))
    assert any(not torch.allclose(trained[k], kept[k], atol=1e-5) for k in kept)
    for key, value in kept.items():  # (switching back and forth rounds the last bits)
        assert torch.allclose(saved[key], value, atol=1e-7), key
    # Back in training mode afterwards: the weights it trains again.
    after = get_peft_model_state_dict(trainer.model)
    assert all(torch.allclose(after[k], trained[k], atol=1e-7) for k in trained)
