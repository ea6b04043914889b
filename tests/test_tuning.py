"""The trainer configures itself (autocast, checkpointing) from measurement, says why, and the
speed choices do not change what is learned."""

import pytest

from gbray.data.turns import index_folder
from gbray.settings import Recipe
from gbray.trainer import Trainer
from gbray.tuning import choose


def recipe(**kw):
    base = dict(
        hours=1.0, epochs=1, lr=1e-3, batch=2, accum=1, lora_r=4, lora_alpha=8, max_len=256,
        answer_room=32, val_turns=4, val_every_minutes=0, val_every_steps=0, seed=1,
        device="cpu", threads=1, exam_turns=10, turns=12, lora_dropout=0.0,
        share_prefix=False,  # the choices tested here, one micro-step at a time
    )  # fmt: skip
    base.update(kw)
    return Recipe(**base)


@pytest.fixture(scope="module")
def turns(corpus):
    train, _ = index_folder(corpus)
    return train.read(list(range(16)))


def run(student, turns, out, **kw):
    """Train and return the per-micro-step losses and the choices made."""
    trainer = Trainer(str(student), None, recipe(**kw), out)
    seen = []
    original = trainer.micro_step

    def record(examples, state):
        value = original(examples, state)
        seen.append(value)
        return value

    trainer.micro_step = record
    summary = trainer.train(turns[:12], turns[12:])
    return seen, summary


def test_checkpointing_does_not_change_what_is_learned(raw_student, turns, tmp_path):
    on, s_on = run(raw_student, turns, tmp_path / "on", precision="float32",
                   gradient_checkpointing=True)  # fmt: skip
    off, s_off = run(raw_student, turns, tmp_path / "off", precision="float32",
                     gradient_checkpointing=False)  # fmt: skip
    assert s_on.choices["checkpointing"] and not s_off.choices["checkpointing"]
    assert len(on) == len(off) == 6
    # float32 recomputed: the same to 1e-4 (1.2e-5 apart seen on an AVX2-only CPU, whose kernels
    # sum in another order; a real change of what is learned moves the losses by 1e-2 or more).
    assert on == pytest.approx(off, rel=1e-4)
    assert s_on.best_val_loss == pytest.approx(s_off.best_val_loss, rel=1e-4)


def test_bfloat16_autocast_learns_the_same_within_tolerance(raw_student, turns, tmp_path):
    plain, s_plain = run(raw_student, turns, tmp_path / "f32", precision="float32",
                         gradient_checkpointing=False)  # fmt: skip
    mixed, s_mixed = run(raw_student, turns, tmp_path / "bf16", precision="autocast",
                         gradient_checkpointing=False)  # fmt: skip
    assert s_mixed.choices["autocast"] and not s_plain.choices["autocast"]
    # bfloat16 keeps 8 bits of mantissa: losses of ~6.5 agree to about 1%.
    assert mixed == pytest.approx(plain, rel=0.02)
    assert mixed != plain  # it really ran in bfloat16


def test_without_native_bfloat16_the_trainer_stays_in_float32_and_says_why(
    raw_student, turns, tmp_path
):
    lines = []
    trainer = Trainer(
        str(raw_student), None, recipe(precision="auto"), tmp_path, report=lines.append,
        native_bf16=lambda: (False, "the CPU has no native bfloat16 (simulated)"),
    )  # fmt: skip
    summary = trainer.train(turns[:12], turns[12:])
    assert summary.choices["autocast"] is False
    assert summary.choices["why_precision"] == "the CPU has no native bfloat16 (simulated)"
    assert any(
        line.startswith("configured: float32 (the CPU has no native bfloat16") for line in lines
    ), lines


def test_checkpointing_follows_the_measured_memory():
    calls = []

    def step_on(tokens, autocast, checkpointing):
        calls.append((tokens, autocast, checkpointing))
        return tokens * 10**6  # a MB of activations a token

    small = choose(recipe(precision="float32"), 2, "cpu", step_on, longest=1000)
    assert not small.checkpointing and "GB free" in small.why_checkpointing
    huge = choose(recipe(precision="float32"), 2, "cpu", step_on, longest=10**8)
    assert huge.checkpointing and "would need about" in huge.why_checkpointing
    forced = choose(recipe(precision="float32", gradient_checkpointing=False), 2, "cpu", step_on,
                    longest=10**8)  # fmt: skip
    assert not forced.checkpointing and forced.why_checkpointing.startswith("asked")
    # The memory probe ran without checkpointing, on a short turn.
    assert all(t <= 256 and not c for t, _, c in calls)


def test_autocast_is_chosen_only_when_the_probe_shows_it_faster():
    import time

    def step_on(slow_in_bf16):
        def step(tokens, autocast, checkpointing):
            time.sleep(0.02 if autocast == slow_in_bf16 else 0.001)
            return 1000

        return step

    native = lambda: (True, "the CPU has AVX512-BF16")  # noqa: E731
    faster = choose(recipe(), 2, "cpu", step_on(False), 512, native)
    slower = choose(recipe(), 2, "cpu", step_on(True), 512, native)
    assert faster.autocast and "faster" in faster.why_precision
    assert not slower.autocast and "slower" in slower.why_precision
    gpu = choose(recipe(gradient_checkpointing=True), 2, "cuda", step_on(False), 512, native)
    assert not gpu.autocast and "GPU" in gpu.why_precision


def test_one_thread_is_chosen_only_when_a_probe_runs_faster_on_it():
    import time

    import torch

    def step_on(seconds_on_many, seconds_on_one):
        def step(tokens, autocast, checkpointing):
            time.sleep(seconds_on_many if torch.get_num_threads() > 1 else seconds_on_one)
            return 1000

        return step

    before = torch.get_num_threads()
    auto = recipe(precision="float32", threads=0)
    try:
        busy = choose(auto, 2, "cpu", step_on(0.03, 0.01), longest=100)
        assert busy.threads == 1 and torch.get_num_threads() == 1
        assert "faster on 1 thread than on 2" in busy.why_threads and "1 threads" in busy.line()
        idle = choose(auto, 2, "cpu", step_on(0.01, 0.015), longest=100)
        assert idle.threads == 2 and torch.get_num_threads() == 2
        assert idle.why_threads == "the CPUs the actor holds"
        asked = choose(recipe(precision="float32", threads=2), 2, "cpu", step_on(0.03, 0.01),
                       longest=100)  # fmt: skip
        assert asked.threads == 2 and asked.why_threads.startswith("fixed by the recipe")
        off = choose(recipe(precision="float32", threads=0, thread_probe=False), 2, "cpu",
                     step_on(0.03, 0.01), longest=100)  # fmt: skip
        assert off.threads == 2 and off.why_threads.startswith("fixed by the recipe")
    finally:
        torch.set_num_threads(before)
