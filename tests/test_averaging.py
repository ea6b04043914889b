"""Shares averaging while they train (local SGD): the averager's arithmetic and freshness, and a
trainer that carries on from the average it is handed. No Ray: the actor is a shell over these."""

import math
import threading
import time

import pytest
import torch
from peft import get_peft_model_state_dict
from test_trainer import recipe

from gbray.averaging import Averager
from gbray.data.turns import index_folder
from gbray.shares import stale_syncs
from gbray.trainer import Trainer


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def weights(value: float) -> dict:
    return {"a": torch.full((2, 3), value), "b": torch.full((3,), -value)}


def test_the_first_share_s_start_is_the_global_and_a_late_joiner_gets_what_was_learned():
    averager = Averager(outer_lr=1.0, clock=Clock())
    assert torch.equal(averager.join(0, weights(1.0))["a"], weights(1.0)["a"])
    averager.exchange(0, weights(3.0), 10)  # alone: its whole movement, +2
    late = averager.join(1, weights(0.0))  # a node that joined mid-night
    assert torch.allclose(late["a"], torch.full((2, 3), 3.0))


def test_outer_lr_one_averages_the_movements_and_the_number_of_shares_sums_them():
    for outer_lr, expected in ((1.0, 2.0), (2.0, 3.0)):
        averager = Averager(outer_lr=outer_lr, clock=Clock())
        for share in (0, 1):
            averager.join(share, weights(1.0))
        averager.exchange(0, weights(2.0), 10)  # moved +1
        got = averager.exchange(1, weights(2.0), 10)  # moved +1 from the same start
        assert torch.allclose(got["a"], torch.full((2, 3), expected)), outer_lr
        assert torch.allclose(got["b"], torch.full((3,), -expected)), outer_lr


def test_a_stale_movement_counts_in_proportion_and_does_not_drag_the_global_back():
    averager = Averager(outer_lr=2.0, clock=Clock())
    for share in (0, 1):
        averager.join(share, weights(0.0))
    for _ in range(3):  # the fast share syncs three times, 30 turns and +1 each
        averager.exchange(0, weights(averager_view(averager, 0) + 1.0), 30)
    # The slow share, handed the start, moved +1 on 10 turns while the global took in 90 of the
    # other's: it counts twice an even round's turns (2 x 10) over the 90, added to the global.
    got = averager.exchange(1, weights(1.0), 10)
    assert torch.allclose(got["a"], torch.full((2, 3), 3.0 + 20 / 90))
    stale = averager.syncs[-1]
    assert stale.share == 1 and stale.staleness == 3 and stale.turns == 10
    assert stale.freshness == stale.weight == round(20 / 90, 4)
    # Its next movement, from the global it was just handed, counts whole again.
    averager.exchange(1, weights(averager_view(averager, 1) + 1.0), 10)
    assert averager.syncs[-1].freshness == 1.0


def test_the_round_notes_the_syncs_counted_in_part():
    averager = Averager(outer_lr=1.0, clock=Clock())
    for share in (0, 1):
        averager.join(share, weights(0.0))
    for _ in range(3):
        averager.exchange(0, weights(averager_view(averager, 0) + 1.0), 30)
    assert stale_syncs(averager.result()[1]) == ""
    averager.exchange(1, weights(1.0), 10)
    said = stale_syncs(averager.result()[1])
    assert said == "; 1 of them stale, counted in part (freshness down to 0.22)", said


def test_shares_of_one_pace_count_whole_when_one_syncs_twice_in_a_row():
    averager = Averager(outer_lr=1.0, clock=Clock())
    for share in (0, 1):
        averager.join(share, weights(0.0))
    for share in (0, 1, 1, 0):  # share 1 syncs twice before share 0 again: equal shares' jitter
        averager.exchange(share, weights(averager_view(averager, share) + 1.0), 8)
    assert [s.freshness for s in averager.syncs] == [1.0] * 4
    assert [s.weight for s in averager.syncs] == [0.5] * 4


def averager_view(averager: Averager, share: int) -> dict:
    """What `share` was last handed, as weights(x) would make it: its "a" value."""
    return averager.given[share][0]["a"][0, 0].item()


def test_nesterov_momentum_is_updated_once_per_outer_step():
    averager = Averager(outer_lr=1.0, outer_momentum=0.5, clock=Clock())
    for share in (0, 1):
        averager.join(share, weights(0.0))
    averager.exchange(0, weights(2.0), 10)  # +1 applied at once; no momentum yet
    assert averager.state.weights["a"][0, 0].item() == 1.0
    # The outer step: +1 more, so g = 2 this step, m = 2, and the global gets 0.5 * m on top.
    averager.exchange(1, weights(2.0), 10)
    assert averager.state.weights["a"][0, 0].item() == 3.0


def test_a_share_that_left_or_was_dropped_keeps_what_it_synced():
    averager = Averager(outer_lr=2.0, clock=Clock())
    for share in (0, 1):
        averager.join(share, weights(0.0))
    averager.exchange(1, weights(1.0), 10)  # +1 then its machine goes away
    averager.drop(1)
    averager.leave(0, weights(1.0), 5)  # the last movement of the other, scaled 2/1
    final, syncs, members = averager.result()
    assert torch.allclose(final["a"], torch.full((2, 3), 3.0))
    assert [s["final"] for s in syncs] == [False, True]
    assert {m["share"]: m["turns_synced"] for m in members} == {0: 5, 1: 10}
    assert all(m["left_minute"] is not None for m in members)


class ZeroingSync:
    """Every exchange hands back zeros, as if the other shares had learned nothing."""

    pools = False

    def __init__(self):
        self.joined, self.exchanges, self.turns, self.left = 0, 0, [], None

    def join(self, weights: dict) -> dict:
        self.joined += 1
        return weights

    def due(self, turns_since: int) -> bool:
        return turns_since >= 2

    def exchange(self, mine: dict, turns: int) -> dict:
        self.exchanges += 1
        self.turns.append(turns)
        time.sleep(0.25)  # an averager on another machine: what the trainer spends waiting
        return {k: torch.zeros_like(v) for k, v in mine.items()}

    def leave(self, weights: dict | None, turns: int) -> None:
        self.left = (weights, turns)


def test_the_trainer_carries_on_from_the_average_it_is_handed(raw_student, corpus, tmp_path):
    train, _ = index_folder(corpus)
    turns = train.read(list(range(12)))
    sync = ZeroingSync()
    trainer = Trainer(str(raw_student), None, recipe(accum=1), tmp_path, sync=sync)
    summary = trainer.train(turns[:8], turns[8:12])
    # 8 turns, batch 2, accumulation 1: four steps, each followed by an exchange of the 2 turns
    # since the last; the last one leaves the adapter all zeros (LoRA's A and B both zero get no
    # gradient after it), and what it hands in on leaving is those zeros.
    assert summary.steps == 4 and sync.exchanges == 4 and summary.averaged == 4
    # What the syncs cost is told apart from the training's time (4 waits of 0.25 s).
    assert 1.0 / 60 <= summary.sync_minutes <= summary.minutes, summary
    assert sync.joined == 1 and sync.turns == [2, 2, 2, 2] and sync.left[1] == 0
    lora = get_peft_model_state_dict(trainer.model)
    assert lora and all(float(v.abs().max()) == 0.0 for v in lora.values())


def test_syncs_come_every_so_many_turns_of_the_fastest_share():
    from types import SimpleNamespace

    from gbray.shares import sync_turns

    night = SimpleNamespace(
        job=SimpleNamespace(recipe=SimpleNamespace(batch=8, accum=2)), average_every_seconds=9.0
    )  # fmt: skip
    # 36,000 turns an hour is 10 a second: 90 turns in 9 s, whatever the slower shares do.
    assert sync_turns(night, [36_000.0, 12_000.0]) == 90
    # A machine too slow for one step in the interval still syncs once per step (16 turns).
    assert sync_turns(night, [600.0]) == 16


def test_a_slow_share_counts_by_its_speed_and_does_not_slow_the_fast_one():
    averager = Averager(outer_lr=1.0, clock=Clock())
    for share in (0, 1):
        averager.join(share, weights(0.0))
    averager.set_speeds({0: 3000.0, 1: 1000.0})  # share 1 is three times slower
    for _ in range(3):  # the fast share syncs three times, +1 each: counted 1 / (1 + 1/3)
        averager.exchange(0, weights(averager_view(averager, 0) + 1.0), 30)
    averager.exchange(1, weights(1.0), 30)  # the slow share's one sync in that time, +1
    # The fast share's movements count 0.75 each, as much with the slow one beside it; the slow
    # one's, handed the start 90 turns of the other's ago, counts 2 x 30 / 90 of that.
    assert torch.allclose(averager.state.weights["a"], torch.full((2, 3), 3 * 0.75 + 0.5))
    assert [s.weight for s in averager.syncs] == [0.75, 0.75, 0.75, 0.5]


def test_pooled_gradients_are_the_turn_weighted_mean_of_each_share_s_newest_step_taken_once():
    averager = Averager(clock=Clock())
    for share in (0, 1, 2):
        averager.join(share, weights(0.0))
    # The first to step finds nothing on the board: its own gradient, its own turns.
    mine, turns = averager.pool(0, weights(1.0), 8)
    assert turns == 8 and torch.equal(mine["a"], weights(1.0)["a"])
    averager.pool(1, weights(4.0), 4)  # takes share 0's step
    # Share 2 takes both newest steps, each weighted by its turns: (2*8 + 1*8 + 4*4) / 20.
    mine, turns = averager.pool(2, weights(2.0), 8)
    assert turns == 20 and torch.allclose(mine["a"], torch.full((2, 3), 40 / 20))
    # Share 1 stepped twice since share 0 last pooled: only its newest counts, and only once.
    averager.pool(1, weights(7.0), 4)
    mine, turns = averager.pool(0, weights(1.0), 8)
    assert turns == 8 + 4 + 8  # share 1's newest and share 2's, share 1's first never
    assert torch.allclose(mine["b"], torch.full((3,), -(8 * 1 + 4 * 7 + 8 * 2) / 20))
    mine, turns = averager.pool(0, weights(1.0), 8)
    assert turns == 8  # nothing new since
    # A share that left is no longer pooled from.
    averager.pool(2, weights(5.0), 8)
    averager.leave(2)
    assert averager.pool(0, weights(1.0), 8)[1] == 8


def test_a_pooled_step_s_rate_follows_the_turns_pooled_against_a_whole_step():
    """sqrt(turns pooled / a whole step's turns), at least 1: two members stepping together on one
    pooled gradient step at one rate even where one's step is short (its part of the slice ran
    out mid-step), so they keep one adapter; alone, a short step keeps the recipe's rate."""
    from types import SimpleNamespace

    averager = Averager()
    model = torch.nn.Linear(3, 2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    me = SimpleNamespace(
        model=model, recipe=recipe(batch=2, accum=4), clock=time.monotonic, sync_seconds=0.0,
        pooled_turns=0, sync=SimpleNamespace(pool=lambda grads, turns: averager.pool(0, grads, turns)),
    )  # fmt: skip
    grads = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    averager.pool(1, grads, 8)  # the partner's whole step of 8 turns
    assert Trainer.pool_gradients(me, 3) == pytest.approx(math.sqrt(11 / 8))
    assert me.pooled_turns == 8
    assert torch.allclose(model.weight.grad, torch.full((2, 3), 3 / 11))
    assert Trainer.pool_gradients(me, 3) == 1.0  # nothing new from the partner: alone


def pooling_night(raw_student, corpus, tmp_path, averager: Averager) -> tuple[list, list]:
    """Two shares of one 6-second night in threads, pooling every step through `averager`:
    their trainers and what each trained."""

    from gbray.averaging import LocalLink

    train, _ = index_folder(corpus)
    turns = train.read(list(range(48)))
    night = recipe(hours=6 / 3600, epochs=50, accum=1, val_every_minutes=5)
    # Built one after the other: loading models in two threads at once is not safe.
    trainers = [
        Trainer(str(raw_student), None, night, tmp_path / f"s{i}",
                sync=LocalLink(averager, i, every_turns=8, pools=True))
        for i in (0, 1)
    ]  # fmt: skip
    ends_at = time.time() + 6
    done = {}

    def share(i: int) -> None:
        done[i] = trainers[i].train(turns[i * 20 : i * 20 + 20], turns[40:44], ends_at)

    runs = [threading.Thread(target=share, args=(i,)) for i in (0, 1)]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    return trainers, [done[0], done[1]]


def test_shares_that_pool_take_in_each_other_s_turns_and_train_on(raw_student, corpus, tmp_path):
    """Each steps on the other's gradients as well as its own, never more turns than the other
    trained."""
    averager = Averager(clock=Clock())
    _, done = pooling_night(raw_student, corpus, tmp_path, averager)
    for i in (0, 1):
        mine, other = done[i], done[1 - i]
        assert mine.why == "time" and mine.steps > 2, mine
        assert 0 < mine.pooled_turns <= other.turn_passes, (mine.pooled_turns, other.turn_passes)
        assert all(torch.isfinite(v).all() for v in averager.state.weights.values())
    assert done[0].sync_minutes > 0


def in_thread(call, *args):
    """`call(*args)` in a thread; returns the thread and a dict that will hold its result."""

    out = {}
    thread = threading.Thread(target=lambda: out.update(value=call(*args)))
    thread.start()
    return thread, out


def test_two_trainers_stepping_together_take_every_step_on_both_shares_turns(
    raw_student, corpus, tmp_path
):
    """Stepping together, each of their steps is taken on both shares' turns (what one machine
    with both batches would step on), so each takes in the other's turns whole and both end on
    nearly the same adapter."""
    averager = Averager(together=True)
    averager.set_speeds({0: 1.0, 1: 1.0})
    trainers, done = pooling_night(raw_student, corpus, tmp_path, averager)
    members = {m["share"]: m for m in averager.result()[2]}
    for i in (0, 1):
        mine, other = done[i], done[1 - i]
        assert mine.steps > 3, mine
        # Every step of the other's but those after this one had left.
        assert mine.pooled_turns >= other.turn_passes - 2 * 8, (mine, other)
        assert members[i]["grouped"], members
        # The group synced as one (one member handing in the weights both hold), and every
        # turn each trained is counted once: in the group's posts, then in its last movement.
        assert members[i]["turns_synced"] == mine.turn_passes, (members, mine)
    assert any(s["grouped"] for s in averager.result()[1])
    # LoRA's B starts at zero, so its size is how far the shares moved; they moved alike. Not
    # exactly: the member whose time runs out second may take its last step alone, on its own
    # turns, after its partner has left (CI once: a gap of 1.2% of the movement in a night of
    # about a dozen steps). Two shares from one start on their own turns, neither pooling nor
    # syncing, end half the movement apart (measured here once: 0.50 after 14 steps each).
    assert abs(done[0].steps - done[1].steps) <= 1, (done[0].steps, done[1].steps)
    apart = [trainers[0].adapter_weights(), trainers[1].adapter_weights()]
    moved = max(v.abs().max().item() for k, v in apart[0].items() if "lora_B" in k)
    gap = max((apart[0][k] - apart[1][k]).abs().max().item() for k in apart[0])
    assert moved > 0 and gap < 0.05 * moved, (gap, moved)
