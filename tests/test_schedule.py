"""The night's learning rate (gbray.schedule) and which check's adapter it keeps
(gbray.validation): plain functions, no model."""

import math

import pytest

from gbray.schedule import Schedule
from gbray.validation import Check, keeps, most_right


def wsd(data_total=1000, **kw):
    return Schedule.new("wsd", 1e-3, 0.1, 0.05, data_total, 0.2, **kw)


def test_wsd_warms_up_holds_the_peak_then_cools_down_over_the_last_fifth_of_the_time():
    s = wsd()
    assert s.rate(0, 0, 100) == 0 and s.rate(25, 0, 100) == pytest.approx(5e-4)
    assert s.phase(25) == "warm-up" and s.phase(50) == "stable"
    # Time: 100 s of training; steps of 0.1 s, the data far away (1000 steps is 100 s).
    assert s.cool_down_due(500, 50.0, 100.0) is None
    assert s.rate(500, 50.0, 100.0) == 1e-3
    assert s.cool_down_due(800, 80.0, 100.0) == "time"
    s.begin_cool_down(800, 80.0, 100.0, "time")
    assert s.phase(801) == "cool-down"
    rates = [s.rate(800 + k, 80.0 + k * 0.1, 100.0) for k in range(0, 201, 20)]
    assert rates[0] == pytest.approx(1e-3) and rates[-1] == pytest.approx(1e-4)
    assert rates == sorted(rates, reverse=True)
    # 1 - sqrt: a quarter of the way, half the fall is done.
    assert s.rate(850, 85.0, 100.0) == pytest.approx(1e-4 + 9e-4 * 0.5)
    assert s.record()["cooldown_why"] == "time" and s.record()["cooldown_began_step"] == 800


def test_wsd_cools_down_before_the_data_ends_when_that_comes_first():
    s = wsd(data_total=100)
    assert s.cool_down_due(79, 10.0, 1000.0) is None
    assert s.cool_down_due(80, 10.0, 1000.0) == "data"
    s.begin_cool_down(80, 10.0, 1000.0, "data")
    assert s.rate(90, 11.0, 1000.0) == pytest.approx(1e-4 + 9e-4 * (1 - math.sqrt(0.5)))
    assert s.rate(100, 12.0, 1000.0) == pytest.approx(1e-4)


def test_a_plateau_cools_down_from_where_the_rate_stands_for_a_quarter_of_the_time_so_far():
    s = wsd()
    s.begin_cool_down(400, 40.0, 100.0, "plateau")
    assert s.cool_from == 1e-3 and s.cool_until == pytest.approx(50.0)
    assert s.cooled(450, 45.0, 100.0) == pytest.approx(0.5)
    assert s.cooled(500, 50.0, 100.0) == 1.0 and s.rate(500, 50.0, 100.0) == pytest.approx(1e-4)
    # It never runs past the end of the night's training time.
    late = wsd()
    late.begin_cool_down(900, 90.0, 100.0, "plateau")
    assert late.cool_until == 100.0


def test_the_cool_down_follows_the_clock_not_the_steps():
    # Two shares of one night, one ten times slower: both cool down when a fifth of the night's
    # time is left, and reach the floor together at its end.
    fast, slow = wsd(data_total=10_000), wsd(data_total=10_000)
    # Each has re-planned from its own speed: 0.1 s and 1 s a step.
    assert fast.replan(5, 0.1, 99.5) and slow.replan(5, 1.0, 95.0)
    assert fast.cool_down_due(799, 79.9, 100.0) is slow.cool_down_due(79, 79.9, 100.0) is None
    assert fast.cool_down_due(800, 80.0, 100.0) == slow.cool_down_due(80, 80.0, 100.0) == "time"
    fast.begin_cool_down(800, 80.0, 100.0, "time")
    slow.begin_cool_down(80, 80.0, 100.0, "time")
    assert fast.rate(900, 90.0, 100.0) == pytest.approx(slow.rate(90, 90.0, 100.0))
    assert fast.rate(1000, 100.0, 100.0) == slow.rate(100, 100.0, 100.0) == pytest.approx(1e-4)


def test_a_replan_moves_the_warm_up_only_while_it_is_ahead():
    s = wsd(data_total=1000)
    assert s.warmup == 50
    assert s.replan(5, 1.0, 195.0) and s.total == 200 and s.warmup == 10
    assert s.replan(30, 1.0, 970.0) and s.total == 1000 and s.warmup == 10  # already past it


def check(step, marks, loss):
    return Check(step, step, loss, 100 * marks.count("1") / len(marks), marks, 1e-3, "stable", 0)


def test_the_kept_check_names_more_turns_right_not_the_lower_loss():
    kept = check(1, "1" * 30 + "0" * 34, 0.50)
    # Lower loss, but it names the recorded tool on 10 turns fewer (all of them the kept one's).
    collapsed = check(2, "1" * 20 + "0" * 44, 0.40)
    assert not keeps(collapsed, kept, kept, 1e-4, "agreement")
    assert keeps(collapsed, kept, kept, 1e-4, "loss")  # the rule nights had before
    better = check(3, "1" * 42 + "0" * 22, 0.55)
    assert keeps(better, kept, kept, 1e-4, "agreement")


def test_a_wobble_within_the_noise_is_a_tie_the_loss_breaks():
    kept = check(1, "1" * 30 + "0" * 34, 0.50)
    # Two turns more right (3 gained, 1 lost): within 2 sd of the paired difference.
    wobble = check(2, "0" + "1" * 29 + "111" + "0" * 31, 0.52)
    assert not keeps(wobble, kept, kept, 1e-4, "agreement")
    lower = check(3, "0" + "1" * 29 + "111" + "0" * 31, 0.45)
    assert keeps(lower, kept, kept, 1e-4, "agreement")


def marked(right: set[int], n: int = 64) -> str:
    return "".join("1" if i in right else "0" for i in range(n))


def test_ties_never_walk_the_kept_adapter_below_the_best_check_seen():
    top = check(1, marked(set(range(40))), 0.50)
    kept = check(2, marked(set(range(37))), 0.45)  # 3 fewer: within the noise, lower loss
    assert keeps(kept, top, top, 1e-4, "agreement")
    # Against `kept`: 3 gained, 10 lost, within the noise, and a lower loss again. Against
    # `top`: 2 gained, 12 lost: beyond the noise below the best check seen.
    lower = check(3, marked(set(range(10, 37)) | {37, 40, 41}), 0.40)
    assert keeps(lower, kept, None, 1e-4, "agreement")
    assert not keeps(lower, kept, top, 1e-4, "agreement")
    assert most_right([kept, top, lower]) is top


def test_a_check_without_a_finite_loss_is_never_kept():
    nan = Check(1, 1, None, 100.0, "1" * 10, 1e-3, "stable", 0)
    assert not keeps(nan, None, None, 1e-4, "agreement")
