from pathlib import Path

import pytest
import torch

from gbray.data.fit import IGNORE, make_example
from gbray.data.turns import index_folder
from gbray.settings import Recipe
from gbray.trainer import Plan, Trainer, TrainState, make_scheduler, planned_steps, replan


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
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=r.lr)
    plan = Plan(total=600, warmup=30)
    sched = make_scheduler(opt, plan, r, done=0)
    lrs = []
    for step in range(1, 121):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        if step == 5:
            # 5 steps took 10 s each and 1150 s are left: 115 more fit, not 595.
            new = replan(plan, 600, 5, 10.0, 1150.0, r)
            assert new.total == 120 and new.warmup == 6 and new.replanned_from == 600
            plan = new
            sched = make_scheduler(opt, plan, r, done=5)
    assert lrs[-1] == pytest.approx(r.lr * r.min_lr_ratio, rel=1e-6)
    assert max(lrs) == pytest.approx(r.lr, rel=0.02)  # it did leave its warm-up


def test_replan_never_goes_past_the_data_plan():
    r = recipe()
    plan = Plan(total=50, warmup=3)
    assert replan(plan, 50, 5, 1.0, 10_000.0, r) is plan
    shrunk = replan(plan, 50, 5, 1.0, 20.0, r)
    assert shrunk.total == 25
    # Faster than the first estimate: it grows back, but never past the data's 50.
    assert replan(shrunk, 50, 10, 1.0, 10_000.0, r).total == 50


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
    sched = make_scheduler(
        trainer.optimizer, Plan(10, 0), trainer.recipe, 0
    )  # no warm-up: lr > 0 at once
    trainer.optimizer_step(state, sched)
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
def test_patience_stops_training_only_once_its_share_of_the_hours_is_spent(
    raw_student, turns, tmp_path, after, why
):
    # Every check after the first is "without gain" (a gain must beat the best by 1e9), so one
    # such check is patience enough; an hour's budget is far from half spent in these seconds.
    trainer = Trainer(
        str(raw_student), None,
        recipe(accum=1, val_every_steps=1, patience=1, min_gain=1e9, patience_after=after),
        tmp_path,
    )  # fmt: skip
    summary = trainer.train(turns[:12], turns[30:34])
    assert summary.why == why
    assert summary.steps == (2 if why == "patience" else 6)
