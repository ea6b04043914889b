"""Shares of equal speed stepping together (gbray.peers): the group they form, its all-reduce, how
it ends when a partner leaves or proves slow, and the same over Ray between two actors."""

import threading
import time

import pytest
import torch
from test_averaging import in_thread, weights

from gbray.averaging import PEER_SPEED, Averager
from gbray.peers import SETTLING_STEPS, SLOW_WINDOW, StepGroup, Together


def a_group(averager: Averager, shares=(0, 1)) -> dict[int, StepGroup]:
    """The group's members, met through `averager` over 127.0.0.1 (each in its own thread: a
    member waits for the others to meet)."""
    made = {}

    def meet(share: int) -> None:
        rank_size = averager.place(share)
        made[share] = StepGroup(
            *rank_size, "127.0.0.1", averager.post_meeting, averager.meeting_point, PEER_SPEED
        )

    threads = [threading.Thread(target=meet, args=(i,)) for i in shares]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(made) == sorted(shares), made
    return made


def a_night_of_two(wait: float) -> tuple[Averager, dict[int, StepGroup]]:
    """Two shares of one speed: their averager, both joined, and their group."""
    averager = Averager(wait=wait)
    averager.set_speeds({0: 1.0, 1: 1.0})
    group = a_group(averager)
    for share in (0, 1):
        averager.join(share, weights(0.0))
    return averager, group


def test_shares_of_alike_speed_form_the_group_and_a_slow_one_stays_out_of_it():
    averager = Averager(wait=1.0)
    averager.set_speeds({0: 3.0, 1: 1.0, 2: 2.9})
    assert averager.place(0) == (0, 2) and averager.place(2) == (1, 2)
    assert averager.place(1) is None
    for share in (0, 1, 2):
        averager.join(share, weights(0.0))
    # Nobody waits for the slow share at a sync, and it waits for nobody.
    began = time.monotonic()
    averager.exchange(1, weights(1.0), 8)
    assert time.monotonic() - began < 0.1 and averager.partners(1) == []
    assert averager.partners(0) == [2]
    # A share placed again was started again (its process lost): its group has gone on without
    # it, so it steps outside the group and nobody waits for it.
    assert averager.place(2) is None and averager.partners(0) == []
    # With no wait bound (--no-step-together) there is no group.
    apart = Averager()
    apart.set_speeds({0: 1.0, 1: 1.0})
    assert apart.place(0) is None and apart.place(1) is None


def test_a_group_steps_on_the_turn_weighted_mean_and_is_handed_one_global():
    averager, group = a_night_of_two(wait=2.0)
    first, got = in_thread(group[0].pool, weights(1.0), 8)
    time.sleep(0.05)  # the partner is a little late: the first waits for its step
    theirs, turns = group[1].pool(weights(3.0), 4)
    first.join()
    # Both step on both machines' turns, weighted by them: one step of a machine with both.
    assert turns == 12 and got["value"][1] == 12
    assert torch.equal(theirs["a"], got["value"][0]["a"])
    assert torch.allclose(theirs["a"], torch.full((2, 3), 20 / 12))
    # A sync: the first to arrive waits for its partner's movement, so both get the same global
    # (both movements applied), not the first a global with only its own half in it.
    first, got = in_thread(averager.exchange, 0, weights(1.0), 16)
    time.sleep(0.1)
    handed = averager.exchange(1, weights(1.0), 16)
    first.join()
    assert torch.allclose(got["value"]["a"], weights(1.0)["a"])
    assert torch.equal(handed["a"], got["value"]["a"])
    _, syncs, members = averager.result()
    assert syncs[0]["waited_seconds"] >= 0.05 and syncs[1]["waited_seconds"] < 0.05
    assert all(m["grouped"] and m["group_left_minute"] is None for m in members), members


def test_a_partner_that_leaves_ends_the_group_at_once_and_the_wait_for_it():
    averager, group = a_night_of_two(wait=50.0)
    left = []
    together = Together(None, "", None, None, left.append, PEER_SPEED)
    together.group = group[0]
    waiting, got = in_thread(together.pool, weights(1.0), 8)
    time.sleep(0.2)
    began = time.monotonic()
    group[1].close()  # its night ended first: the partner's all-reduce fails, not times out
    waiting.join(timeout=10)
    assert not waiting.is_alive() and time.monotonic() - began < 2
    assert got["value"][1] == 8 and torch.equal(got["value"][0]["a"], weights(1.0)["a"])
    assert not together.stepping and len(left) == 1 and "gone" in left[0], left
    # At a sync, a partner that left the night is waited for no more.
    time.sleep(0.1)
    waiting, got = in_thread(averager.exchange, 0, weights(1.0), 8)
    time.sleep(0.2)
    began = time.monotonic()
    averager.leave(1)
    waiting.join(timeout=3)
    assert not waiting.is_alive() and time.monotonic() - began < 1


def stepping(group: dict[int, StepGroup], pauses: dict[int, list[float]]) -> None:
    """Each member steps after each of its pauses, in its own thread, until its pauses or the
    group are over."""

    def steps(share: int) -> None:
        for pause in pauses[share]:
            if group[share].over:
                return
            time.sleep(pause)
            group[share].pool(weights(1.0), 8)

    threads = [threading.Thread(target=steps, args=(i,)) for i in group]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)


def test_a_member_whose_steps_prove_slow_ends_the_group_for_every_member():
    averager = Averager(wait=1.0)
    averager.set_speeds({0: 1.0, 1: 1.0})
    # One long step (a validation, a save) is not a slow pace.
    steps = SETTLING_STEPS + 2 * SLOW_WINDOW
    group = a_group(averager)
    pause = [0.01] * steps
    stepping(group, {0: pause, 1: pause[:10] + [0.3] + pause[11:]})
    assert not group[0].over and not group[1].over and group[0].steps == steps
    # A slow pace is: both read the same times and end at the same step, once a window is timed.
    averager = Averager(wait=1.0)
    averager.set_speeds({0: 1.0, 1: 1.0})
    group = a_group(averager)
    stepping(group, {0: [0.01] * steps, 1: [0.1] * steps})
    assert group[0].steps == group[1].steps == SETTLING_STEPS + SLOW_WINDOW
    assert group[0].slow_member() == group[1].slow_member() == 1
    assert group[0].over and group[1].over


@pytest.fixture(scope="module")
def ray2():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_two_share_actors_step_together_through_their_own_all_reduce(ray2):
    """The Ray side: the averager actor places the shares and tells them where to meet; their
    links pool each step straight between the two processes, and a share that leaves ends the
    group for the other at once."""
    from gbray.actors import AveragerActor, AveragerLink

    @ray2.remote(num_cpus=1)
    class Share:
        def __init__(self, averager, index: int):
            self.link = AveragerLink(averager, index)

        def night(self, value: float, turns: int, steps: int) -> list:
            def full(v: float) -> dict:  # built here: the test module is not on a worker's path
                return {"a": torch.full((2, 3), v), "b": torch.full((3,), -v)}

            self.link.join(full(0.0))
            pooled = []
            for _ in range(steps):
                grads, total = self.link.pool(full(value), turns)
                pooled.append((round(grads["a"][0, 0].item(), 4), total))
            self.link.leave(full(1.0), turns * steps)
            return pooled

    averager = AveragerActor.remote(1.0, 0.0, True, 1.0)
    ray2.get(averager.set_every_turns.remote(8, {0: 1.0, 1: 1.0}))
    shares = [Share.remote(averager, 0), Share.remote(averager, 1)]
    first, second = ray2.get([shares[0].night.remote(1.0, 8, 3), shares[1].night.remote(3.0, 4, 2)])
    # Both stepped on both shares' turns, weighted by them, for as long as both stepped.
    assert first[:2] == second == [(round(20 / 12, 4), 12)] * 2, (first, second)
    # Share 1 left after two steps: share 0's third all-reduce failed at once, and it stepped
    # on its own turns.
    assert first[2] == (1.0, 8), first


def test_a_share_that_loses_the_averager_ends_its_group_so_its_partner_steps_on_at_once(ray2):
    """A share whose sync finds the averager gone (the driver's machine lost) trains on alone
    and closes its group: its partner's next all-reduce fails at once, not after its timeout."""
    from gbray.actors import AveragerActor, AveragerLink

    @ray2.remote(num_cpus=1)
    class Share:
        def __init__(self, averager, index: int):
            self.link = AveragerLink(averager, index)

        def night(self, steps: int, lose_averager_after: int | None) -> list:
            def full(v: float) -> dict:
                return {"a": torch.full((2, 3), v), "b": torch.full((3,), -v)}

            self.link.join(full(0.0))
            took = []
            for step in range(steps):
                if step == lose_averager_after:
                    gone = AveragerActor.remote(1.0, 0.0)
                    ray2.kill(gone)
                    self.link.averager = gone
                    moved = self.link.exchange(full(2.0), 8)
                    took.append(("synced alone", moved["a"][0, 0].item(), self.link.pools))
                    time.sleep(5)  # training on, no longer pooling
                    return took
                began = time.monotonic()
                _, total = self.link.pool(full(1.0), 8)
                took.append((total, time.monotonic() - began))
            return took

    averager = AveragerActor.remote(1.0, 0.0, True, 1.0)
    ray2.get(averager.set_every_turns.remote(8, {0: 1.0, 1: 1.0}))
    shares = [Share.remote(averager, 0), Share.remote(averager, 1)]
    steady, lost = ray2.get([shares[0].night.remote(3, None), shares[1].night.remote(3, 1)])
    # Its own weights back and no more pooling, where the averager was gone.
    assert lost[1] == ("synced alone", 2.0, False), lost
    assert [total for total, _ in steady] == [16, 8, 8], steady
    # The step that met the closed group failed over at once (the timeout is 60 s).
    assert steady[1][1] < 20, steady
