"""What a round asks of the machines it runs on: exams, training (one trainer or N shares) and the
merge. Two kinds: `RayCluster` (gbray.ray_cluster: every trainer and every exam in an actor of its
own, on whatever nodes the cluster has) and `LocalCluster` (gbray.local_cluster: all of it in
this process, one after another; the round's branches get tests in seconds). The round never asks
which one it holds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from gbray.settings import Recipe, TrainerJob

if TYPE_CHECKING:
    from gbray.hub.client import Hub
    from gbray.results import ExamResult, TrainSummary
    from gbray.shares import ShareNight, Trained


class Exam(Protocol):
    """An exam under way; `result` waits for it (Stopped if the owner says stop meanwhile)."""

    def result(self, hub: Hub, what: str) -> ExamResult: ...


class Cluster(Protocol):
    def resolve(self, recipe: Recipe) -> Recipe:
        """The recipe for these machines: its device, and the threads one actor gets."""
        ...

    def hub(self, settings: dict) -> Hub:
        """A client of the hub (`ClientSettings`' fields) that trainers and examiners report
        through."""
        ...

    def room_for(self, actors: int, threads: int) -> bool:
        """Whether `actors` of `threads` CPUs each fit at once (a baseline beside the shares)."""
        ...

    def exam(self, model: str, adapter: str | None, recipe: Recipe, paper: list[dict],
             log_path: Path, hub: Hub) -> Exam: ...  # fmt: skip

    def train(self, job: TrainerJob, train: list[dict], val: list[dict],
              hub: Hub) -> tuple[TrainSummary, dict]:  # fmt: skip
        """One trainer over the slice: its summary and its process record."""
        ...

    def train_shares(self, night: ShareNight, n: int, train: list[dict], val: list[dict],
                     hub: Hub, note: Callable[[str], None]) -> Trained:  # fmt: skip
        """`n` shares of the slice, each a round of its own on the hub, and what became of each."""
        ...

    def merge(self, folders: list[str], out: Path, method: str, weights: list[float]) -> dict:
        """The survivors' adapters joined into `out`; the merge's report."""
        ...
