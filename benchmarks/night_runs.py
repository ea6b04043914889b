"""What the night benchmarks share: their corpus and tiny student, one `gbray round` run as a
subprocess (a night already run is read, not rerun), and the command-line options for both."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from gbray.data.synth import SynthSettings, write_corpus
from gbray.student import StudentSettings, build_student


def add_corpus_options(
    ap: argparse.ArgumentParser, turns: int, work: str, page_tokens: int = 500
) -> None:
    ap.add_argument("--paper", type=int, default=150, help="exam turns")
    ap.add_argument("--turns", type=int, default=turns, help="training turns in the corpus")
    ap.add_argument("--page-tokens", type=int, default=page_tokens, help="the corpus' prompt size")
    ap.add_argument("--work", type=Path, default=Path(work),
                    help="corpus, student and nights (a night already there is read, not rerun)")  # fmt: skip


def prepare(work: Path, turns: int, page_tokens: int, **synth) -> tuple[Path, Path]:
    """The corpus (`gbray synth` with seed 5 and `synth`'s settings) and the tiny student
    pre-trained on it for 450 steps, built once under `work`."""
    data, student = work / "data", work / "student"
    if not (student / "config.json").is_file():
        write_corpus(
            SynthSettings(out=data, turns=turns, seed=5, prompt_tokens=page_tokens, **synth)
        )
        build_student(StudentSettings(data=data, out=student, pretrain_steps=450, seed=0))
    return data, student


def prepare_learnable(work: Path, **synth) -> tuple[Path, Path]:
    """A learnable corpus (14 tools, 180-token pages; `synth` may change its wording; the tests
    used it until they took the demo's) and its tiny student pre-trained 420 steps, built once
    under `work`."""
    data, student = work / "data", work / "student"
    if not (student / "config.json").is_file():
        write_corpus(
            SynthSettings(out=data, turns=2500, eval_turns=300, seed=11, prompt_tokens=180,
                          tools=14, **synth)
        )  # fmt: skip
        build_student(StudentSettings(data=data, out=student, pretrain_steps=420, vocab=1024))
    return data, student


def round_command(data: Path, student: Path, out: Path, minutes: float, seed: int, paper: int,
                  *flags: str) -> list[str]:  # fmt: skip
    """One night on the tiny student's own recipe, one thread, plus `flags`."""
    return [
        sys.executable, "-m", "gbray.cli", "round", "--data", str(data), "--model", str(student),
        "--out", str(out), "--hours", str(minutes / 60), "--seed", str(seed), "--threads", "1",
        "--exam-turns", str(paper), *flags,
    ]  # fmt: skip


def trial_command(student: Path, out: Path, paper: int, *flags: str) -> list[str]:
    """One `gbray trial` (an exam of a candidate, in a process of its own), plus `flags`."""
    return [
        sys.executable, "-m", "gbray.cli", "trial", "--model", str(student), "--out", str(out),
        "--threads", "1", "--exam-turns", str(paper), *flags,
    ]  # fmt: skip


def run_round(command: list[str], out: Path) -> dict:
    """Run the night unless its round.json is there; return its round.json."""
    if not (out / "round.json").is_file():
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"the night {out.name} failed:\n{run.stderr[-3000:]}")
    return json.loads((out / "round.json").read_text())


def simulated_cluster(kinds: list[str], head_cpus: int = 1):
    """A `ray.cluster_utils.Cluster` of a head and one one-CPU node per kind, each with its own
    resource."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": head_cpus,
            "resources": {"head": 1},
            "include_dashboard": False,
        },
    )
    for kind in kinds:
        cluster.add_node(num_cpus=1, resources={kind: 1})
    cluster.wait_for_nodes()
    return cluster


def spread(values: list[float]) -> dict:
    """The mean of a figure over the seeds, its standard deviation and every seed's value."""
    return {
        "mean": round(statistics.mean(values), 2),
        "stdev": round(statistics.stdev(values), 2) if len(values) > 1 else None,
        "each": values,
    }
