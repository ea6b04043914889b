"""What a round trains and is examined on (SPEC §4 step 1): the slice with its validation turns,
and the paper. From the hub, or from the local data folder when there is none (or it cannot be
reached); the validation turns are split off the slice the same way on both paths, whole jobs at
a time, so no job feeds both training and validation."""

from __future__ import annotations

import hashlib
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

from gbray.data.sampler import draw
from gbray.data.turns import BadLines, DataError, TurnIndex, parse_turn
from gbray.hub.client import Hub
from gbray.settings import Recipe

log = logging.getLogger(__name__)


@dataclass
class Work:
    train: list[dict]
    val: list[dict]
    paper: list[dict]
    paper_id: str
    scope: str
    bad_lines: dict

    @property
    def paper_record(self) -> dict:
        return {"id": self.paper_id, "scope": self.scope, "turns": len(self.paper)}


def paper_of(evaluation: TurnIndex, turns: int) -> tuple[list[dict], str]:
    """The fixed paper: the first `turns` usable eval turns; its id is a hash of their lines."""
    paper = evaluation.read(list(range(min(turns, len(evaluation)))))
    digest = hashlib.sha256()
    for turn in paper:
        digest.update(json.dumps(turn, sort_keys=True).encode())
    return paper, "p-" + digest.hexdigest()[:12]


def split_validation(turns: list[dict], want: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, validation): whole jobs, drawn at random, go to validation until it holds about
    `want` turns (at most a fifth of the slice)."""
    want = min(want, len(turns) // 5)
    jobs: dict[str, list[int]] = {}
    for i, turn in enumerate(turns):
        jobs.setdefault(turn.get("job") or f"#{i}", []).append(i)
    names = sorted(jobs)
    random.Random(seed).shuffle(names)
    held: set[int] = set()
    for name in names:
        if len(held) >= want:
            break
        if len(held) + len(jobs[name]) <= max(want, 1) * 2:
            held.update(jobs[name])
    train = [t for i, t in enumerate(turns) if i not in held]
    return train, [t for i, t in enumerate(turns) if i in held]


def local_work(
    data: Path, train: TurnIndex, evaluation: TurnIndex, recipe: Recipe, with_slice: bool
) -> Work:
    paper, paper_id = paper_of(evaluation, recipe.exam_turns)
    scope = f"local:{Path(data).resolve()}"
    bad = {"train": train.bad.as_dict(), "eval": evaluation.bad.as_dict()}
    if not with_slice:
        return Work([], [], paper, paper_id, scope, bad)
    picked = draw(train.tools, train.tiers, recipe.turns + recipe.val_turns, seed=recipe.seed)
    turns, val = split_validation(train.read(picked), recipe.val_turns, recipe.seed)
    log.info(
        "slice: %d turns (seed %d), %d validation turns, paper %s of %d turns; bad lines: %d train, %d eval",
        len(turns), recipe.seed, len(val), paper_id, len(paper), train.bad.total, evaluation.bad.total,
    )  # fmt: skip
    return Work(turns, val, paper, paper_id, scope, bad)


def hub_work(hub: Hub, recipe: Recipe, with_slice: bool) -> Work | None:
    """The slice and the paper from the hub, or None if they cannot be had. Without the slice
    (a trial, a measurement) only the paper is asked for: no turns are taken."""
    lines = hub.slice(recipe.turns + recipe.val_turns) if with_slice else []
    paper = hub.paper(recipe.exam_turns)
    if lines is None or (with_slice and not lines) or not paper or not paper[0]:
        return None
    bad = BadLines()
    turns = [t for i, line in enumerate(lines) if (t := parse_turn(line, f"slice:{i}", bad))]
    exam = [t for i, line in enumerate(paper[0]) if (t := parse_turn(line, f"paper:{i}", bad))]
    train, val = split_validation(turns, recipe.val_turns, recipe.seed)
    log.info("hub: slice of %d turns, paper %s of %d turns", len(turns), paper[1], len(exam))
    return Work(train, val, exam, paper[1], paper[2], {"hub": bad.as_dict()})


def get_work(
    hub: Hub, local: tuple[TurnIndex, TurnIndex] | None, data: Path | None, recipe: Recipe,
    with_slice: bool = True, fetch: bool = True,
) -> Work:  # fmt: skip
    """The hub's work when it can give it (and `fetch`), else the local folder's."""
    work = hub_work(hub, recipe, with_slice) if fetch else None
    if work is not None:
        return work
    if local is None:
        raise DataError("the hub could not be reached and there is no --data to fall back on")
    return local_work(Path(data), *local, recipe, with_slice)
