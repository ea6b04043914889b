"""gbray from a driver script: settings in, typed results out. The CLI's `round`, `trial` and
`hub promote` are thin layers over these three calls; examples/shares_night.py is a whole night
(shares on a cluster, the owner's promotion, a trial of what then serves).

    from gbray.api import Recipe, RoundSettings, night, promote, trial

    done = night(RoundSettings(model="students/tiny", data="corpus", out="rounds/tonight",
                               address="auto", shares=2, hub=URL, token=DEVICE,
                               recipe=Recipe(hours=6)))
    if done.beat:
        print(promote(URL, OWNER, done.hub_round).serving)

Every setting is a field of `RoundSettings` or `Recipe` (`gbray round --help` lists them with
their meaning); they are checked once, when the night starts (`ValueError` with every problem).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gbray.settings import Recipe, RoundSettings

__all__ = ["Night", "Promotion", "Recipe", "RoundSettings", "Trial", "night", "promote", "trial"]


@dataclass(frozen=True)
class Night:
    """What a round became (round.json's headline; `record` is round.json itself)."""

    status: str  # done, stopped or failed
    why: str | None
    start: str  # bare, hub:ID or local:HASH: what it trained from
    baseline_pct: float | None
    result_pct: float | None
    beat: bool  # the result beat the baseline on the same paper
    p_value: float | None  # exact McNemar, from the two exams' per-turn marks
    hub_round: str | None  # its round on the hub (None without a hub, or the hub down)
    adapter: str | None  # its adapter's folder
    shares: int
    out: Path
    record: dict

    @classmethod
    def of(cls, record: dict, out: Path) -> Night:
        from gbray.record import summary_line

        line = summary_line(record, out)
        return cls(
            status=record["status"],
            why=record.get("why"),
            start=record.get("start", "bare"),
            baseline_pct=line["baseline"],
            result_pct=line["result"],
            beat=bool(line["beat"]),
            p_value=line["p_value"],
            hub_round=record.get("hub_round"),
            adapter=record.get("adapter"),
            shares=record.get("shares", 1),
            out=Path(out),
            record=record,
        )


@dataclass(frozen=True)
class Trial:
    """A candidate's score on the paper (trial.json's headline; `record` is trial.json)."""

    status: str
    candidate: str
    result_pct: float | None
    turns: int | None
    hub_round: str | None
    out: Path
    record: dict


@dataclass(frozen=True)
class Promotion:
    """The hub's answer to an owner's promotion: what serves now, or the rule that refused it."""

    promoted: bool
    serving: dict | None
    refused: str | None  # the reason, starting with its rule (`beat its baseline:`, ...)


def night(settings: RoundSettings, cluster=None) -> Night:
    """One night (a round, or `settings.shares` shares and their merge) from start to report.
    `cluster`: where it runs (default Ray's; `gbray.local_cluster.LocalCluster()`: this process)."""
    from gbray.round import run_round

    return Night.of(run_round(settings, cluster), Path(settings.out))


def trial(settings: RoundSettings) -> Trial:
    """Examine `settings.adapter` (a folder, hub:ID, hub:serving, or the bare student) on the
    paper, in an examiner of its own; trains nothing."""
    from gbray.round import run_trial

    record = run_trial(settings)
    result = record.get("result")
    return Trial(
        status=record["status"],
        candidate=record["candidate"],
        result_pct=result["agreement_pct"] if result else None,
        turns=result["turns"] if result else None,
        hub_round=record.get("hub_round"),
        out=Path(settings.out),
        record=record,
    )


def promote(hub: str, owner_token: str, round_id: str, ca: str | None = None) -> Promotion:
    """Ask the hub to put a round into service (an owner's token); raises on anything but an
    answer from the gate (a wrong token, no such round, the hub down)."""
    import requests

    r = requests.post(
        f"{hub.rstrip('/')}/v1/training/rounds/{round_id}/promote",
        headers={"Authorization": f"Bearer {owner_token}"},
        timeout=30,
        **({"verify": ca} if ca else {}),
    )
    if r.status_code == 409:
        return Promotion(promoted=False, serving=None, refused=r.json().get("detail"))
    r.raise_for_status()
    return Promotion(promoted=True, serving=r.json()["serving"], refused=None)
