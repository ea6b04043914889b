"""Shares averaging while they train (local SGD): the averager's arithmetic and freshness, and a
trainer that carries on from the average it is handed. No Ray: the actor is a shell over these."""

import torch
from peft import get_peft_model_state_dict
from test_trainer import recipe

from gbray.data.turns import index_folder
from gbray.shares import Averager, average_weights
from gbray.trainer import Trainer


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def weights(value: float) -> dict:
    return {"a": torch.full((2, 3), value), "b": torch.full((3,), -value)}


def test_the_average_is_weighted_by_the_turns_each_share_trains():
    got = average_weights([(weights(1.0), 100), (weights(4.0), 300)])
    assert torch.allclose(got["a"], torch.full((2, 3), 3.25))
    assert torch.allclose(got["b"], torch.full((3,), -3.25))


def test_each_share_gets_the_average_of_every_share_s_latest_weights():
    clock = Clock()
    averager = Averager(fresh_seconds=60, clock=clock)
    alone, count = averager.exchange(0, weights(2.0), 10)
    assert count == 1 and torch.equal(alone["a"], weights(2.0)["a"])
    clock.now = 5
    both, count = averager.exchange(1, weights(4.0), 10)
    assert count == 2 and torch.allclose(both["a"], torch.full((2, 3), 3.0))
    clock.now = 10  # share 0 again, with new weights: share 1's latest still counts
    again, count = averager.exchange(0, weights(0.0), 30)
    assert count == 2 and torch.allclose(again["a"], torch.full((2, 3), 1.0))


def test_weights_not_handed_in_again_in_time_no_longer_count():
    clock = Clock()
    averager = Averager(fresh_seconds=60, clock=clock)
    averager.exchange(0, weights(2.0), 10)  # share 0's machine goes away after this
    clock.now = 61
    got, count = averager.exchange(1, weights(4.0), 10)
    assert count == 1 and torch.equal(got["a"], weights(4.0)["a"])


def test_a_share_that_finished_no_longer_counts():
    averager = Averager(fresh_seconds=60, clock=Clock())
    averager.exchange(0, weights(2.0), 10)
    averager.leave(0)
    got, count = averager.exchange(1, weights(4.0), 10)
    assert count == 1 and torch.equal(got["a"], weights(4.0)["a"])


class ZeroingSync:
    """Every exchange hands back zeros, as if the other shares had learned nothing."""

    def __init__(self):
        self.exchanges, self.left = 0, False

    def due(self, now: float) -> bool:
        return True

    def exchange(self, mine: dict, turns: int) -> tuple[dict, int]:
        self.exchanges += 1
        return {k: torch.zeros_like(v) for k, v in mine.items()}, 2

    def leave(self) -> None:
        self.left = True


def test_the_trainer_carries_on_from_the_average_it_is_handed(raw_student, corpus, tmp_path):
    train, _ = index_folder(corpus)
    turns = train.read(list(range(12)))
    sync = ZeroingSync()
    trainer = Trainer(str(raw_student), None, recipe(accum=1), tmp_path, sync=sync)
    summary = trainer.train(turns[:8], turns[8:12])
    # 8 turns, batch 2, accumulation 1: four steps, each followed by an exchange; the last one
    # leaves the adapter all zeros (LoRA's A and B both zero get no gradient after it).
    assert summary.steps == 4 and sync.exchanges == 4 and summary.averaged == 4 and sync.left
    lora = get_peft_model_state_dict(trainer.model)
    assert lora and all(float(v.abs().max()) == 0.0 for v in lora.values())
