"""Shares of equal speed stepping together (`--step-together`, the default): at every optimizer
step they sum their gradients, each weighted by its turns, in one all-reduce straight between
their processes (torch.distributed's gloo over TCP), and each steps on the mean: two machines in
lockstep, one step on both machines' turns.

A step's exchange through the averager actor (a Ray call each way) cost a fifth of a share's
steps on two cores, where an all-reduce of the tiny student's LoRA gradients takes a few
milliseconds. The group is made once, at the start of the night, of the shares whose measured
speeds are alike (`PEER_SPEED`); the averager only tells them where to meet.

Nobody waits for a share that has gone: a partner whose process ends closes its sockets and the
all-reduce fails at once; one whose machine vanished fails it after `timeout`. Either way the
group is over, and each share left trains on alone, syncing through the averager. A partner that
proves slow, step after step (`SLOW_STEPS`), ends the group too: every member reads every
member's step times in the same all-reduce, so all of them decide alike, with nothing more said.
"""

from __future__ import annotations

import datetime
import gc
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# Stepping together, the shares with at least this part of the fastest's measured speed step
# together in a group (`gbray.averaging` places them); the group ends when one's steps take longer
# than the fastest's over it.
PEER_SPEED = 0.8
# How long a member waits for its partners to meet at the start, and for a partner's step.
MEET_SECONDS = 120.0
STEP_TIMEOUT_SECONDS = 60.0
# A member is slow when the median of its last SLOW_WINDOW steps' times is over the fastest's
# over PEER_SPEED: a median, since a member validating or saving now and then takes one long step
# that says nothing of its pace. The first SETTLING_STEPS carry start-up costs and do not count.
SLOW_WINDOW = 9
SETTLING_STEPS = 5
# The group ends on a slow member only once it has read as slow at SLOW_STEPS steps in a row:
# ending is for good, and on hosts shared with other work a member's median moves by a fifth for
# a few steps (one night of alike members on the benchmark's simulated cluster dipped to 0.77 of
# its partner's for one step of 717); a machine truly slower is caught SLOW_STEPS steps later.
SLOW_STEPS = 3 * SLOW_WINDOW


@dataclass(frozen=True)
class Posted:
    """The group's last post a member took: its number and the member's turns in it. The member
    hands it to the averager when it syncs alone or leaves, so turns of a post that never arrived
    (its poster's machine gone between the step and the post) are still counted, once."""

    number: int = 0
    turns: int = 0


NO_POST = Posted()  # a share that took no post of a group


class GroupOver(RuntimeError):
    """The group cannot step together any more: a partner left, vanished or proved slow."""


class StepGroup:
    """One share's side of the group: `pool` is its step's all-reduce."""

    def __init__(
        self,
        rank: int,
        world: int,
        host: str,
        post: Callable[[tuple[str, int]], None],
        fetch: Callable[[], tuple[str, int] | None],
        peer_speed: float,
        timeout: float = STEP_TIMEOUT_SECONDS,
    ):
        """`host`: this machine's address, reachable from the partners'. Rank 0 opens the
        meeting point (a TCPStore on a free port of `host`) and `post`s its address; the others
        `fetch` it until it is there."""
        if world < 2 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} of {world}: a group is two or more")
        self.rank, self.world, self.peer_speed = rank, world, peer_speed
        wait = datetime.timedelta(seconds=MEET_SECONDS)
        if rank == 0:
            self.store = dist.TCPStore(host, 0, world, True, timeout=wait, wait_for_workers=False)
            post((host, self.store.port))
        else:
            address = _poll(fetch, MEET_SECONDS)
            self.store = dist.TCPStore(address[0], address[1], world, False, timeout=wait)
        options = dist.ProcessGroupGloo._Options()
        # The device on `host`, not whatever the machine's name resolves to: on a LAN of several
        # interfaces (or network namespaces) that may be one the partners cannot reach.
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = datetime.timedelta(seconds=timeout)
        self.group = dist.ProcessGroupGloo(self.store, rank, world, options)
        # Each member's last steps' times (its own work between all-reduces), alike in every member.
        self.recent: list[list[float]] = [[] for _ in range(world)]
        # Each member's turns since the group last posted its weights to the averager, alike in
        # every member (read from the same all-reduce), and the posts so far.
        self.unposted = [0] * world
        self.posts = 0
        self.returned = time.monotonic()
        self.steps = 0
        self.slow_steps = 0  # steps in a row at which a member read as slow
        self.over = False
        self.why_over = "the group is over"

    def pool(self, grads: dict[str, torch.Tensor], turns: int) -> tuple[dict, int]:
        """The turn-weighted mean of every member's gradients of this step, and the turns behind
        it. Raises GroupOver (the group then stays over) when a partner is gone or slow."""
        if self.over:
            raise GroupOver("the group is over")
        took = time.monotonic() - self.returned
        names = sorted(grads)
        times = torch.zeros(self.world, dtype=torch.float64)
        times[self.rank] = took
        each = torch.zeros(self.world, dtype=torch.float64)
        each[self.rank] = turns
        flat = torch.cat(
            [grads[n].detach().reshape(-1).to(torch.float64) * turns for n in names] + [each, times]
        )
        try:
            self.group.allreduce([flat]).wait()
        except RuntimeError as e:
            self.close()
            raise GroupOver(f"a partner is gone: {str(e).splitlines()[0][:200]}") from e
        self.returned = time.monotonic()
        self.steps += 1
        each = [int(round(t)) for t in flat[-2 * self.world : -self.world].tolist()]
        total = sum(each)
        self.unposted = [n + t for n, t in zip(self.unposted, each, strict=True)]
        if self.steps > SETTLING_STEPS:
            for mine, took_then in zip(self.recent, flat[-self.world :].tolist(), strict=True):
                mine[:] = [*mine[-(SLOW_WINDOW - 1) :], took_then]
        pooled, at = {}, 0
        for n in names:
            size = grads[n].numel()
            chunk = flat[at : at + size] / max(total, 1)
            pooled[n] = chunk.reshape(grads[n].shape).to(grads[n].dtype)
            at += size
        slow = self.slow_member()
        self.slow_steps = 0 if slow is None else self.slow_steps + 1
        if self.slow_steps >= SLOW_STEPS:
            # Every member read the same times, so every member ends the group at this step.
            self.why_over = self.pace_of(slow)
            self.close()
        return pooled, total

    def take_unposted(self) -> tuple[list[int], int]:
        """Each member's turns since the last post, and this post's number (the same in every
        member at the same step); the count starts again."""
        turns, self.unposted = self.unposted, [0] * self.world
        self.posts += 1
        return turns, self.posts

    def slow_member(self) -> int | None:
        """A member whose steps take longer than the fastest's over `peer_speed`, once a whole
        window of steps is timed."""
        if len(self.recent[0]) < SLOW_WINDOW:
            return None
        paces = self.paces()
        slowest = max(range(self.world), key=lambda i: paces[i])
        if paces[slowest] > 0 and min(paces) / paces[slowest] < self.peer_speed:
            return slowest
        return None

    def paces(self) -> list[float]:
        """Each member's median step time over its last SLOW_WINDOW steps."""
        return [statistics.median(times) for times in self.recent]

    def pace_of(self, slow: int) -> str:
        """Why the group ended on a slow member, with the paces it was judged by (round.json's
        `group_left_why`), so a group ended on noise can be told from one ended on a slow machine."""
        paces = self.paces()
        return (
            f"a member's steps proved slow: rank {slow} at {paces[slow]:.3f} s a step against "
            f"{min(paces):.3f} s (medians of the last {SLOW_WINDOW} steps, slow at the last "
            f"{self.slow_steps} steps, at step {self.steps})"
        )

    def close(self) -> None:
        """Leave the group: a partner in an all-reduce with this member fails at once. Gloo
        closes its connections when the process group is freed (its `shutdown` and `abort`
        leave them open, and the partner would wait out its timeout)."""
        if not self.over:
            self.over = True
            self.group = None
            gc.collect()


def _poll(fetch: Callable[[], tuple[str, int] | None], seconds: float) -> tuple[str, int]:
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        address = fetch()
        if address is not None:
            return address
        time.sleep(0.2)
    raise GroupOver(f"no meeting point for the group within {seconds:.0f} s")


class Together:
    """A share's link's side of stepping together: its group while the group lasts, and
    `on_left(why)` told once when it ends (or never met), after which the share trains alone."""

    def __init__(
        self,
        place: tuple[int, int] | None,
        host: str,
        post: Callable[[tuple[str, int]], None],
        fetch: Callable[[], tuple[str, int] | None],
        on_left: Callable[[str], None],
        peer_speed: float = PEER_SPEED,
    ):
        self.group: StepGroup | None = None
        self.on_left = on_left
        if place is None:
            return
        try:
            self.group = StepGroup(*place, host, post, fetch, peer_speed)
        except (GroupOver, RuntimeError) as e:  # a partner never came
            self._end(f"the group never met: {str(e).splitlines()[0][:200]}")

    @property
    def stepping(self) -> bool:
        return self.group is not None

    def pool(self, grads: dict, turns: int) -> tuple[dict, int]:
        """The group's mean gradients; this share's own once the group is over."""
        try:
            pooled = self.group.pool(grads, turns)
        except GroupOver as e:
            self._end(str(e))
            return grads, turns
        if self.group.over:  # every member read one member's steps as slow
            self._end(self.group.why_over)
        return pooled

    def post_due(self, every_turns: float) -> bool:
        """The group syncs as one, at the same step in every member: when the first member's
        turns since the group's last post reach `every_turns` (all read the same count)."""
        return self.group.unposted[0] >= every_turns

    def take_post(self) -> tuple[list[int], int, bool]:
        """Each member's turns since the group's last post, this post's number, and whether
        this member is the one that hands the group's weights in (rank 0)."""
        turns, number = self.group.take_unposted()
        return turns, number, self.group.rank == 0

    def post(self, weights: dict, send: Callable[[dict, list[int], int], None]) -> Posted:
        """The group's sync, at the same step in every member: rank 0 `send`s the weights with
        each member's turns and the post's number; returns the post this member took."""
        rank = self.group.rank
        each, number, posts = self.take_post()
        if posts:
            send(weights, each, number)
        return Posted(number, each[rank])

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    def _end(self, why: str) -> None:
        log.warning("stepping alone from here: %s", why)
        self.group = None
        self.on_left(why)
