"""Shares of equal speed stepping together (gbray.peers): the group they form, its all-reduce, how
it ends when a partner leaves or proves slow, and the same over Ray between two actors."""

import threading
import time

import pytest
import torch
from test_averaging import in_thread, weights

from gbray.averaging import PEER_SPEED, Averager
from gbray.peers import SETTLING_STEPS, SLOW_STEPS, SLOW_WINDOW, Posted, StepGroup, Together


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


def a_night_of_two() -> tuple[Averager, dict[int, StepGroup]]:
    """Two shares of one speed: their averager, both joined, and their group."""
    averager = Averager(together=True)
    averager.set_speeds({0: 1.0, 1: 1.0})
    group = a_group(averager)
    for share in (0, 1):
        averager.join(share, weights(0.0))
    return averager, group


def test_shares_of_alike_speed_form_the_group_and_a_slow_one_stays_out_of_it():
    averager = Averager(together=True)
    averager.set_speeds({0: 3.0, 1: 1.0, 2: 2.9})
    assert averager.place(0) == (0, 2) and averager.place(2) == (1, 2)
    assert averager.place(1) is None
    assert averager.group == [0, 2]
    # A share placed again was started again (its process lost): its group has gone on without
    # it, so it steps outside the group.
    assert averager.place(2) is None and averager.group == [0]
    # --no-step-together: no group.
    apart = Averager()
    apart.set_speeds({0: 1.0, 1: 1.0})
    assert apart.place(0) is None and apart.place(1) is None


def test_a_group_steps_on_the_turn_weighted_mean():
    averager, group = a_night_of_two()
    first, got = in_thread(group[0].pool, weights(1.0), 8)
    time.sleep(0.05)  # the partner is a little late: the first waits for its step
    theirs, turns = group[1].pool(weights(3.0), 4)
    first.join()
    # Both step on both machines' turns, weighted by them: one step of a machine with both.
    assert turns == 12 and got["value"][1] == 12
    assert torch.equal(theirs["a"], got["value"][0]["a"])
    assert torch.allclose(theirs["a"], torch.full((2, 3), 20 / 12))
    members = averager.result()[2]
    assert all(m["grouped"] and m["group_left_minute"] is None for m in members), members


def test_a_group_syncs_as_one_post_of_the_weights_its_members_hold():
    """Stepping together, a sync is one member handing in the group's weights with each member's
    turns (read from the all-reduce): nobody waits or takes a global back, the global becomes the
    group's weights, and a joiner outside the group keeps its own movement in it."""
    averager, group = a_night_of_two()
    for mine, theirs in ((8, 4), (8, 8)):
        first, _ = in_thread(group[0].pool, weights(1.0), mine)
        group[1].pool(weights(1.0), theirs)
        first.join()
    # Every member reads the same turns and the same post number at the same step.
    assert group[0].unposted == group[1].unposted == [16, 12]
    posts = [Together(None, "", None, None, print) for _ in (0, 1)]
    for share in (0, 1):
        posts[share].group = group[share]
    assert posts[0].post_due(16) and posts[1].post_due(16) and not posts[1].post_due(17)
    (each, number, poster), (each1, number1, poster1) = posts[0].take_post(), posts[1].take_post()
    assert each == each1 == [16, 12] and number == number1 == 1 and poster and not poster1
    # A partner done before the post arrived waits for it (its turns are counted there), not
    # for anything else: its own leave then adds only what it moved after the post.
    leaving, _ = in_thread(averager.leave, 1, weights(3.0), 8, Posted(number, each[1]))
    time.sleep(0.2)
    assert leaving.is_alive()
    began = time.monotonic()
    averager.post_group(0, weights(2.0), each, number)
    leaving.join(timeout=5)
    assert not leaving.is_alive() and time.monotonic() - began < 1
    state, syncs, members = averager.result()
    posted = [s for s in syncs if s["grouped"]]
    assert [(s["share"], s["turns"], s["weight"]) for s in posted] == [
        (0, 16, round(16 / 28, 4)), (1, 12, round(12 / 28, 4))
    ]  # fmt: skip
    by_share = {m["share"]: m for m in members}
    assert by_share[0]["turns_synced"] == 16 and by_share[1]["turns_synced"] == 12 + 8
    # The global was the group's weights (2.0), then share 1's movement after the post (3.0 -
    # 2.0) counted at half, as any share's last movement among two live shares.
    assert torch.allclose(state["a"], torch.full((2, 3), 2.5))
    # A joiner outside the group starts from the global; the group's next post adds what the
    # group moved since its last one (not its position), at the group's part of the speeds, so
    # the joiner's movement stays in.
    averager.join(2, weights(0.0))
    averager.exchange(2, weights(3.5), 8)  # the joiner moved +1.0, counted at 1/2 (two live)
    assert torch.allclose(averager.result()[0]["a"], torch.full((2, 3), 3.0))
    averager.post_group(0, weights(4.0), [8, 0], 2)  # the group moved +2.0 since its post
    assert torch.allclose(averager.result()[0]["a"], torch.full((2, 3), 4.0))


def test_a_post_that_arrives_late_or_never_counts_each_member_s_turns_once(monkeypatch):
    """Both members take the group's post 2 (8 turns each); its poster (share 0) hands it in
    late, or its machine goes away first. Share 1, whose group ended, syncs alone with the post
    it took: its turns in that post are counted once, by the post if it arrived, else by its own
    sync (its weights hold them), and the group's movement is in the global once."""
    import gbray.averaging

    monkeypatch.setattr(gbray.averaging, "POST_WAIT_SECONDS", 0.3)

    def after_post_1() -> Averager:
        averager, group = a_night_of_two()
        for member in group.values():
            member.close()
        averager.post_group(0, weights(1.0), [8, 8], 1)  # the global is the group's 1.0
        averager.leave_group(1, "its partner went quiet", 2)
        return averager

    def turns_synced(averager: Averager) -> dict[int, int]:
        return {m["share"]: m["turns_synced"] for m in averager.result()[2]}

    # The post arrives after share 1 left the group, before its own sync: it counts both.
    averager = after_post_1()
    averager.post_group(0, weights(2.0), [8, 8], 2)
    averager.exchange(1, weights(3.0), 4, Posted(2, 8))  # +1 since the post, at 1/2
    assert turns_synced(averager) == {0: 16, 1: 8 + 8 + 4}
    assert torch.allclose(averager.result()[0]["a"], torch.full((2, 3), 2.5))
    # The poster's machine goes away: share 1's sync waits for the post, then brings its 8 turns
    # of it in with its own 4, and its movement from post 1's weights (+2, whole: alone now).
    averager = after_post_1()
    averager.drop(0)
    began = time.monotonic()
    averager.exchange(1, weights(3.0), 4, Posted(2, 8))
    assert time.monotonic() - began >= 0.3
    assert turns_synced(averager) == {0: 8, 1: 8 + 8 + 4}
    assert averager.result()[1][-1]["turns"] == 12
    assert torch.allclose(averager.result()[0]["a"], torch.full((2, 3), 3.0))
    # The poster was only slow: its post, arriving after share 1 brought its turns in, adds the
    # group's movement (+1 from post 1, at the poster's half) and its own turns, not share 1's.
    averager = after_post_1()
    averager.exchange(1, weights(3.0), 4, Posted(2, 8))  # +2 at 1/2: the global is 2.0
    averager.post_group(0, weights(2.0), [8, 8], 2)
    assert turns_synced(averager) == {0: 16, 1: 8 + 8 + 4}
    assert torch.allclose(averager.result()[0]["a"], torch.full((2, 3), 2.5))


def test_a_partner_that_leaves_ends_the_group_at_once():
    averager, group = a_night_of_two()
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
    def fresh_group() -> dict[int, StepGroup]:
        averager = Averager(together=True)
        averager.set_speeds({0: 1.0, 1: 1.0})
        return a_group(averager)

    fast, slow = 0.01, 0.1
    # One long step (a validation, a save) is not a slow pace, and neither is a slow spell
    # shorter than SLOW_STEPS (a host busy with other work for a few seconds).
    spell = SLOW_STEPS - SLOW_WINDOW // 2 - 2
    steps = SETTLING_STEPS + 2 * SLOW_WINDOW + spell + SLOW_WINDOW
    start = SETTLING_STEPS + 2 * SLOW_WINDOW
    bumpy = [fast] * steps
    bumpy[10] = 0.3
    bumpy[start : start + spell] = [slow] * spell
    group = fresh_group()
    stepping(group, {0: [fast] * steps, 1: bumpy})
    assert not group[0].over and not group[1].over and group[0].steps == steps
    # A slow pace is: both read the same times and end at the same step, once a window is timed
    # and the pace held for SLOW_STEPS steps.
    group = fresh_group()
    stepping(group, {0: [fast] * steps, 1: [slow] * steps})
    assert group[0].steps == group[1].steps == SETTLING_STEPS + SLOW_WINDOW + SLOW_STEPS - 1
    assert group[0].slow_member() == group[1].slow_member() == 1
    assert group[0].over and group[1].over
    # Both say why with the same paces (round.json's group_left_why): the slow one's about 0.1 s.
    assert group[0].why_over == group[1].why_over and "rank 1 at 0.1" in group[0].why_over
    assert f"slow at the last {SLOW_STEPS} steps" in group[0].why_over


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

    averager = AveragerActor.remote(1.0, 0.0, True, True)
    ray2.get(averager.set_every_turns.remote(8, {0: 1.0, 1: 1.0}))
    shares = [Share.remote(averager, 0), Share.remote(averager, 1)]
    first, second = ray2.get([shares[0].night.remote(1.0, 8, 3), shares[1].night.remote(3.0, 4, 2)])
    # Both stepped on both shares' turns, weighted by them, for as long as both stepped.
    assert first[:2] == second == [(round(20 / 12, 4), 12)] * 2, (first, second)
    # Share 1 left after two steps: share 0's third all-reduce failed at once, and it stepped
    # on its own turns.
    assert first[2] == (1.0, 8), first


def test_a_share_that_loses_the_averager_ends_its_group_so_its_partner_steps_on_at_once(ray2):
    """The member that posts the group's syncs (rank 0), finding the averager gone (the
    driver's machine lost), trains on alone and closes its group: its partner's next all-reduce
    fails at once, not after its timeout."""
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

    averager = AveragerActor.remote(1.0, 0.0, True, True)
    ray2.get(averager.set_every_turns.remote(8, {0: 1.0, 1: 1.0}))
    shares = [Share.remote(averager, 0), Share.remote(averager, 1)]
    lost, steady = ray2.get([shares[0].night.remote(3, 1), shares[1].night.remote(3, None)])
    # Its own weights back and no more pooling, where the averager was gone.
    assert lost[1] == ("synced alone", 2.0, False), lost
    assert [total for total, _ in steady] == [16, 8, 8], steady
    # The step that met the closed group failed over at once (the timeout is 60 s).
    assert steady[1][1] < 20, steady
