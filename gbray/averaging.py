"""How shares of one night become one adapter while they train: an outer optimizer over what each
share moved since it last synced (DiLoCo, arXiv 2311.08105, made asynchronous as in Async
Local-SGD, arXiv 2401.09135).

The averager holds the night's global adapter. A share joins with its start and gets the global
back (a share that joins late starts from what the others have learned). Every few turns it hands
in its weights; what it moved since it was last handed the global (its pseudo-gradient, negated)
is applied at once, scaled by `outer_lr` over the live shares (counted by their speed relative to
the fastest), and it gets the new global back. Nobody waits:
machines differ by 100x. A movement is added, never a position averaged in, so a slow share's
update does not drag the global back to where it last synced. A stale movement still repeats what
the global has since learned from the others (the same task on other turns), and added whole it
overshoots: the README's shares night measures a slow share's one late sync halving a merge. So a
movement counts whole while the global has taken in at most twice the turns the other shares
bring in an even round (the jitter of equal shares) and in proportion beyond that
(staleness-aware, as in Zhang et al., arXiv 1511.05950).
Nesterov momentum is updated once per outer step (as many arrivals as there are shares: the
delayed Nesterov of Async Local-SGD), so a fast share does not build momentum on its own.

With pooled gradients (`--no-step-together --pool-gradients`) the shares also come closer to one
trainer taking steps on all their turns at once: at every step a share hands the averager its step's
gradient and takes back the mean of it and every other share's newest gradient it has not taken yet
(weighted by turns), and its own Adam steps on that at sqrt(turns pooled / a whole step's) times
the rate (at least once), Adam's rule for a larger batch. Nobody waits: a share whose partner has not stepped since steps on
its own turns. The positions are still averaged every few turns as above.

Stepping together (the default) makes the shares of about the fastest's measured speed
(PEER_SPEED) two machines in lockstep: they form a group that sums every step's gradients in one
all-reduce between their processes (`gbray.peers`; the averager tells them where to meet).
Started from one global and handed the same pooled gradient at every step, their weights and Adam
moments stay alike, so each step is one step on all their turns at the current weights
(benchmarks/stale_gradients.py: a gradient one step stale is worth about half). So the group syncs
as one (`post_group`): at the same step in every member, one member hands in the weights they all
hold, with each member's turns (read from the all-reduce), and nobody waits for a partner's
movement or takes a global back. A sync through the averager (a Ray call each way, a copy of the
adapter) cost the group steps on two cores (the README); the post costs one member one call. A
share not in the group (slower, or a joiner, whose speed is not measured) does not pool: it syncs
as above.

Outer lr 1 without momentum is the plain average of the shares' movements; outer lr = shares is
their sum (each share's turns count as if one trainer had trained them in turn). The choice and
its figures: the README's shares night. Optimizer moments stay in each share.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from gbray.peers import NO_POST, PEER_SPEED, Posted, Together


@dataclass
class Sync:
    """One share's movement applied to the global: what round.json's `syncs` lists."""

    share: int
    turns: int  # turns it trained since its last sync: what the movement is worth
    staleness: int  # other shares' syncs applied since it was last handed the global
    weight: float  # the scale its movement was applied with
    minute: float
    final: bool = False
    freshness: float = 1.0  # the part of `weight` left after staleness (1: counted whole)
    # Stepping together: its turns came in the group's post (one member handing in the weights
    # every member holds), and `weight` is the post's scale times its part of the post's turns.
    grouped: bool = False


@dataclass
class Membership:
    """A share's comings and goings, for round.json and the hub."""

    share: int
    joined_minute: float
    left_minute: float | None = None
    turns_synced: int = 0
    syncs: int = 0
    # Stepping together: whether it stepped in the group, and when and why its group ended for
    # it (a partner gone or slow).
    grouped: bool = False
    group_left_minute: float | None = None
    group_left_why: str | None = None


@dataclass
class OuterState:
    """The global adapter, its momentum and the bookkeeping of who handed in what."""

    weights: dict
    momentum: dict
    pending: dict  # movements applied since the momentum was last updated
    arrivals: int = 0
    version: int = 0
    turns_in: int = 0  # turns behind every movement applied so far


# How long a share that leaves, or syncs on its own after its group ended, waits for the group's
# post that counted its last turns to arrive (the posting member may be a step behind it).
POST_WAIT_SECONDS = 30.0


class Averager:
    """The night's global adapter and its outer optimizer (thread-safe: shares call at once)."""

    def __init__(
        self,
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        together: bool = False,
    ):
        """`together`: shares of about the fastest's speed step together (`gbray.peers`)."""
        if not outer_lr > 0 or not 0 <= outer_momentum < 1:
            raise ValueError("outer lr must be > 0 and outer momentum in [0, 1)")
        self.outer_lr, self.outer_momentum, self.clock = outer_lr, outer_momentum, clock
        self.together = together
        self.began = clock()
        self.state: OuterState | None = None
        # share -> (weights handed, version then, turns the global held then)
        self.given: dict[int, tuple[dict, int, int]] = {}
        self.members: dict[int, Membership] = {}
        self.syncs: list[Sync] = []
        self.speeds: dict[int, float] = {}  # share -> speed relative to the fastest (1 unknown)
        self.lock = threading.Lock()
        # Pooled gradients: share -> (post number, its newest step's gradients, their turns), its
        # posts so far (kept when it leaves the board), and (reader, writer) -> the writer's last
        # post the reader took.
        self.board: dict[int, tuple[int, dict, int]] = {}
        self.posts: dict[int, int] = {}
        self.taken: dict[tuple[int, int], int] = {}
        # Stepping together: the group's live members (chosen by the speeds measured before the
        # night; a member whose group ended leaves it), their ranks, who was placed, where they
        # meet, and the group's posts of its weights so far.
        self.group: list[int] = []
        self.ranks: dict[int, int] = {}  # the group as it met: share -> its rank
        self.placed: set[int] = set()
        self.meeting: tuple[str, int] | None = None
        self.group_posts = 0  # the group's posts of its weights so far
        self.posts_in = threading.Condition(self.lock)
        # A member that left the group is still in its posts up to the last one it took; one
        # whose post never arrived brought that post's turns in itself, and the post, should it
        # arrive later, no longer counts them.
        self.left_after: dict[int, int] = {}
        self.brought: dict[int, int] = {}

    def set_speeds(self, speeds: dict[int, float]) -> None:
        """The shares' measured speeds. A movement is scaled by outer_lr over the live shares'
        speeds relative to the fastest: with equal speeds that is 1/N (the average); a share
        three times slower counts a third, so the fast shares move the global as fast as they
        would without it, and its own (rarer) movements add to theirs."""
        top = max(speeds.values(), default=0.0)
        with self.lock:
            self.speeds = {i: v / top for i, v in speeds.items()} if top > 0 else {}
            alike = sorted(i for i, v in self.speeds.items() if v >= PEER_SPEED)
            self.group = alike if self.together and len(alike) > 1 else []
            self.ranks = {share: rank for rank, share in enumerate(self.group)}

    def place(self, share: int) -> tuple[int, int] | None:
        """Stepping together: this share's rank in the group and the group's size, once a night
        (None: it is not in the group). A share that asks again was started again (its process
        or machine lost): its group has met and gone on, so it trains on outside it."""
        with self.lock:
            if share not in self.ranks:
                return None
            if share in self.placed:
                self.group = [i for i in self.group if i != share]
                self.left_after[share] = 0  # its old process's posts are not its own
                return None
            self.placed.add(share)
            return self.ranks[share], len(self.ranks)

    def post_meeting(self, address: tuple[str, int]) -> None:
        with self.lock:
            self.meeting = tuple(address)

    def meeting_point(self) -> tuple[str, int] | None:
        with self.lock:
            return self.meeting

    def leave_group(self, share: int, why: str, posted: int = 0) -> None:
        """A member whose group ended: it syncs on alone. `posted`: the group's last post it
        took, which still counts it should it arrive after this."""
        with self.lock:
            if share in self.group:
                self.group = [i for i in self.group if i != share]
                self.left_after[share] = posted
                if share in self.members:
                    self.members[share].group_left_minute = self.minute()
                    self.members[share].group_left_why = why

    def shares_worth(self) -> float:
        return sum(self.speeds.get(i, 1.0) for i in self.given)

    def freshness(self, turns: int, taken_in_since: int) -> float:
        """How much of a movement of `turns` counts, the global having taken in `taken_in_since`
        turns of the others since the share was handed it: whole up to twice an even round's
        (each other share bringing as many), in proportion beyond."""
        even_round = max(1, len(self.members) - 1) * turns
        return min(1.0, 2 * even_round / taken_in_since) if taken_in_since > 0 else 1.0

    def minute(self) -> float:
        return round((self.clock() - self.began) / 60, 3)

    def live(self) -> int:
        return len(self.given)

    def join(self, share: int, weights: dict) -> dict:
        """A share starts: the global so far (its own start, if it is the first)."""
        with self.lock:
            if self.state is None:
                start = {k: v.detach().float().clone() for k, v in weights.items()}
                zeros = {k: torch.zeros_like(v) for k, v in start.items()}
                self.state = OuterState(start, zeros, {k: v.clone() for k, v in zeros.items()})
            self.members.setdefault(share, Membership(share, self.minute()))
            self.members[share].left_minute = None
            self.members[share].grouped |= share in self.group
            return self._hand(share, like=weights)

    def exchange(self, share: int, weights: dict, turns: int, posted: Posted = NO_POST) -> dict:
        """This share's weights in, its movement applied; the new global out. `posted`: the
        group's last post this share took (a share whose group has ended)."""
        with self.lock:
            turns += self._turns_of_a_lost_post(share, posted)
            self._apply(share, weights, turns, final=False)
            return self._hand(share, like=weights)

    def post_group(self, share: int, weights: dict, turns: list[int], number: int) -> None:
        """The group stepping together syncs as one: its members hold the same weights (one
        start, the same gradient every step), so one member hands them in, with each member's
        turns since the last post (by rank), and nobody waits or takes a global back. What the
        group moved since its last post is applied as one movement, scaled by outer_lr times the
        group's part of the live shares' speeds: with no other share live the global becomes the
        group's weights. A share outside the group (a joiner) keeps its own movements in."""
        with self.lock:
            if share not in self.given:  # dropped as gone and heard from again
                self._hand(share, like=self.state.weights)
                return
            members = [i for i in self.ranks if i in self.given and self._in_post(i, number)]
            total = sum(turns[self.ranks[i]] for i in members)
            handed, version, _ = self.given[share]
            state = self.state
            worth = sum(self.speeds.get(i, 1.0) for i in members)
            scale = self.outer_lr * worth / max(1.0, self.shares_worth())
            staleness = self._add(weights, handed, version, scale, total, len(members))
            mine = {k: v.detach().float().clone() for k, v in weights.items()}
            for i in members:
                part = turns[self.ranks[i]]
                # The members carry on from their own weights, not a global: what each moves
                # from here is measured from what was handed in.
                self.given[i] = (mine, state.version, state.turns_in)
                self.syncs.append(
                    Sync(i, part, staleness, round(scale * part / max(1, total), 4),
                         self.minute(), grouped=True)
                )  # fmt: skip
                self.members[i].turns_synced += part
                self.members[i].syncs += 1
            self.group_posts = max(self.group_posts, number)
            self.posts_in.notify_all()

    def _in_post(self, share: int, number: int) -> bool:
        """Whether the group's post `number` counts this member's turns."""
        if self.brought.get(share, 0) >= number:
            return False
        return share in self.group or number <= self.left_after.get(share, 0)

    def _turns_of_a_lost_post(self, share: int, posted: Posted) -> int:
        """Under the lock: wait until the group's post this share took is in (at most
        POST_WAIT_SECONDS: its poster may be a step behind). If it never came, the share's turns
        in it are brought in with its own movement, which holds them (the weights it was handed
        are still those of the post before); the post no longer counts them."""
        if posted.number > self.group_posts:
            self.posts_in.wait_for(
                lambda: self.group_posts >= posted.number, timeout=POST_WAIT_SECONDS
            )
        if posted.number <= self.group_posts:
            return 0
        self.brought[share] = posted.number
        return posted.turns

    def pool(self, share: int, grads: dict, turns: int) -> tuple[dict, int]:
        """This share's step's gradients in; out, their mean with each other live share's
        newest step it has not taken yet, weighted by turns, and the turns behind that mean."""
        with self.lock:
            number = self.posts.get(share, 0) + 1
            self.posts[share] = number
            self.board[share] = (number, grads, turns)
            total = {k: v.float() * turns for k, v in grads.items()}
            pooled = turns
            for other, (posted, theirs, t) in self.board.items():
                if other == share or self.taken.get((share, other), 0) >= posted:
                    continue
                self.taken[(share, other)] = posted
                for k in total:
                    total[k] += theirs[k].float() * t
                pooled += t
            return {k: (v / pooled).to(grads[k].dtype) for k, v in total.items()}, pooled

    def leave(
        self, share: int, weights: dict | None = None, turns: int = 0, posted: Posted = NO_POST
    ) -> None:
        """A share is done: its last movement (if it trained since its last sync) is applied.
        `posted`: as in `exchange`."""
        with self.lock:
            turns += self._turns_of_a_lost_post(share, posted)
            if share not in self.given:
                return
            if weights is not None and turns > 0:
                self._apply(share, weights, turns, final=True)
            del self.given[share]
            self.board.pop(share, None)
            self.members[share].left_minute = self.minute()

    def drop(self, share: int) -> None:
        """A share whose machine went away: what it synced stays in the global."""
        with self.lock:
            self.board.pop(share, None)
            if self.given.pop(share, None) is not None:
                self.members[share].left_minute = self.minute()

    def result(self) -> tuple[dict, list[dict], list[dict]]:
        """The global adapter, every sync and every share's membership."""
        with self.lock:
            if self.state is None:
                raise RuntimeError("no share ever joined")
            return (
                {k: v.clone() for k, v in self.state.weights.items()},
                [asdict(s) for s in self.syncs],
                [asdict(m) for m in self.members.values()],
            )

    def _hand(self, share: int, like: dict) -> dict:
        state = self.state
        self.given[share] = (
            {k: v.clone() for k, v in state.weights.items()},
            state.version,
            state.turns_in,
        )
        return {k: state.weights[k].to(like[k].dtype) for k in like}

    def _apply(self, share: int, weights: dict, turns: int, final: bool) -> None:
        """The movement applied and listed. A share dropped as gone and heard from again
        rejoins, handed the global, its movement not applied."""
        if share not in self.given:
            self._hand(share, like=self.state.weights)
            return
        handed, version, turns_then = self.given[share]
        fresh = self.freshness(turns, self.state.turns_in - turns_then)
        scale = self.outer_lr / max(1.0, self.shares_worth()) * fresh
        staleness = self._add(weights, handed, version, scale, turns, 1)
        self.syncs.append(
            Sync(share, turns, staleness, round(scale, 4), self.minute(), final, round(fresh, 4))
        )
        member = self.members[share]
        member.turns_synced += turns
        member.syncs += 1

    def _add(
        self, weights: dict, handed: dict, version: int, scale: float, turns: int, arrivals: int
    ) -> int:
        """Under the lock: the movement `weights - handed` added to the global at `scale`, worth
        `turns` turns and `arrivals` shares' arrivals; returns its staleness (the global's
        versions since the mover was handed `version`)."""
        state = self.state
        for k, w in state.weights.items():
            step = (weights[k].detach().float() - handed[k]) * scale
            w += step
            state.pending[k] += step
        state.turns_in += turns
        staleness = state.version - version
        state.version += 1
        state.arrivals += arrivals
        self._outer_step()
        return staleness

    def _outer_step(self) -> None:
        """Nesterov, once per outer step (as many arrivals as live shares): m <- mu m + g; the
        global gets mu m on top of g."""
        state = self.state
        if self.outer_momentum > 0 and state.arrivals >= len(self.given):
            mu = self.outer_momentum
            for k, w in state.weights.items():
                state.momentum[k].mul_(mu).add_(state.pending[k])
                w += mu * state.momentum[k]
                state.pending[k].zero_()
            state.arrivals = 0


class LocalLink:
    """A share's side of the averaging when the averager is in its own process (the trainer's
    `sync`; gbray.actors.AveragerLink is the same over Ray): a sync every `every_turns` turns.
    Shares in threads of one process step together as those on machines do (`gbray.peers`,
    over 127.0.0.1)."""

    def __init__(self, averager: Averager, index: int, every_turns: float, pools: bool = False):
        self.averager, self.index, self.every_turns = averager, index, every_turns
        self.pools = pools
        self.together = None
        self.posted = NO_POST  # the group's last post this share took

    def join(self, weights: dict) -> dict:
        self.together = Together(
            self.averager.place(self.index),
            "127.0.0.1",
            self.averager.post_meeting,
            self.averager.meeting_point,
            on_left=lambda why: self.averager.leave_group(self.index, why, self.posted.number),
        )
        self.pools = (self.pools and not self.averager.together) or self.together.stepping
        return self.averager.join(self.index, weights)

    def due(self, turns_since: int) -> bool:
        if self.together.stepping:
            return self.together.post_due(self.every_turns)
        return turns_since >= self.every_turns

    def exchange(self, weights: dict, turns: int) -> dict:
        if self.together.stepping:
            self.posted = self.together.post(
                weights, lambda *post: self.averager.post_group(self.index, *post)
            )
            return weights
        return self.averager.exchange(self.index, weights, turns, self.posted)

    def pool(self, grads: dict, turns: int) -> tuple[dict, int]:
        if self.together.stepping:
            return self.together.pool(grads, turns)
        return self.averager.pool(self.index, grads, turns)

    def leave(self, weights: dict | None, turns: int) -> None:
        if self.together is not None:
            self.together.close()
        self.averager.leave(self.index, weights, turns, self.posted)


def save_global(weights: dict, template: Path, out: Path) -> None:
    """The global adapter as a PEFT folder: a share's adapter config, the global's weights."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    shutil.copy2(template / "adapter_config.json", out / "adapter_config.json")
    save_file({k: v.contiguous() for k, v in weights.items()}, out / "adapter_model.safetensors")


def save_merged(averager: Averager, every_turns: float, template: Path, out: Path) -> dict:
    """The night's global adapter written to `out`; what round.json keeps of the averaging."""
    weights, syncs, members = averager.result()
    save_global(weights, template, out)
    return {
        "folder": str(out),
        "outer_lr": averager.outer_lr,
        "outer_momentum": averager.outer_momentum,
        "every_turns": every_turns,
        "syncs": syncs,
        "members": members,
    }
