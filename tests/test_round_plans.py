"""The round's decisions, without Ray and in milliseconds: how the baseline is had, what the
result exam takes after shares, and a night whose every share was lost."""

from pathlib import Path

import pytest

from gbray.round import baseline_plan, check_survivors, merge_plan
from gbray.shares import Share, Trained


def never():
    raise AssertionError("the cluster's room was asked for where it does not matter")


@pytest.mark.parametrize(
    ("skip", "known", "answer", "shares", "room", "plan"),
    [
        (True, False, None, 2, never, "skipped"),
        (False, True, {"known": True}, 2, never, "known"),
        (False, False, {"known": False, "measure": False, "by": "desktop"}, 1, never, "deferred"),
        (False, False, {"known": False, "measure": True}, 2, lambda: True, "beside"),
        (False, False, {"known": False, "measure": True}, 2, lambda: False, "now"),
        (False, False, None, 1, never, "now"),  # no hub: measured before training
    ],
)
def test_how_the_baseline_is_had(skip, known, answer, shares, room, plan):
    assert baseline_plan(skip, known, answer, shares, room) == plan


def shares(*lost: int, n: int = 3) -> list[Share]:
    out = []
    for i in range(n):
        share = Share(i, adapter=f"share-{i}/best")
        share.lost = "its machine went away" if i in lost else None
        out.append(share)
    return out


def test_what_the_result_exam_takes():
    synced = Trained(shares(1), merged={"folder": "merged"})
    assert merge_plan(synced, False, "cat") == "outer"  # even with a share lost
    assert merge_plan(Trained(shares(1, 2)), False, "cat") == "one"
    assert merge_plan(Trained(shares()), False, "svd") == "svd"
    assert merge_plan(Trained(shares()), True, "cat") == "fedavg"  # the field's merge: syntax


def test_a_night_whose_every_share_was_lost_fails_naming_why():
    check_survivors(Trained(shares(0, 1)))  # one survived: nothing to say
    with pytest.raises(RuntimeError, match="no share survived: share 0: its machine went away"):
        check_survivors(Trained(shares(0, 1, 2)))


def test_pooled_gradients_need_shares_that_sync():
    from gbray.settings import RoundSettings

    apart = dict(data=Path("d"), shares=2, step_together=False)
    RoundSettings(**apart, pool_gradients=True).validate()
    with pytest.raises(ValueError, match="--pool-gradients needs averaging"):
        RoundSettings(**apart, pool_gradients=True, share_average_minutes=0).validate()
    with pytest.raises(ValueError, match="add --no-step-together"):
        RoundSettings(data=Path("d"), shares=2, pool_gradients=True).validate()


def test_shares_step_together_by_default_and_only_where_they_average():
    """Stepping together is the shares' default; off, the night's averager forms no group."""
    from gbray.averaging import Averager
    from gbray.settings import RoundSettings

    s = RoundSettings(data=Path("d"), shares=2)
    s.validate()
    apart = RoundSettings(data=Path("d"), shares=2, step_together=False)
    apart.validate()
    assert s.step_together and not apart.step_together
    for settings, group in ((s, [0, 1]), (apart, [])):
        averager = Averager(together=settings.step_together)
        averager.set_speeds({0: 1.0, 1: 0.9})
        assert averager.group == group


def test_an_unfinished_rounds_files_are_kept_aside_without_overwriting_another(tmp_path):
    from gbray.record import keep_earlier_round

    out = tmp_path / "r"
    out.mkdir()
    assert keep_earlier_round(out).aside is None and list(out.iterdir()) == []
    for night in ("first", "second"):
        (out / "progress.log").write_text(night)
        (out / "share-0" / "last").mkdir(parents=True)
        (out / "data.jsonl").write_text("not a round's")
        moved = keep_earlier_round(out)
        aside = moved.aside
        assert aside == out / "earlier" / ("unfinished" if night == "first" else "unfinished-2")
        assert (aside / "progress.log").read_text() == night and (
            aside / "share-0" / "last"
        ).is_dir()
        assert sorted(p.name for p in out.iterdir()) == ["data.jsonl", "earlier"]
    # Carrying on from the earlier round's adapter in the same OUT finds it where it went.
    assert moved.relocate(str(out / "share-0" / "last")) == str(aside / "share-0" / "last")
    assert moved.relocate(str(out / "data.jsonl")) == str(out / "data.jsonl")
    assert moved.relocate("hub:serving") == "hub:serving" and moved.relocate(None) is None
