"""Does a second machine make a better night? One trainer for H minutes, one for 2H, and N shares
for H, on a simulated cluster of one-CPU nodes, with the same slice seed and paper, seeds 1 2 3.

The corpus is `gbray synth --wording alt` with 500-token pages and 8,000 training turns. On the
synth defaults (300-token pages, 3,000 turns) there is no headroom to measure: the 12-minute
night's slice hit the corpus' end, and with 8,000 turns one trainer reached 86.0% at 6 minutes
and 88.7% at 12 (seed 1), near what the silver labels allow. On a host about 0.6x as fast
(411 steps in 6 minutes) these defaults have no headroom either: the 2H night stays in the tiny
student's flat start (seed 1: 20.0% at H, 10.0% at 2H); `--page-tokens 150 --minutes 3` takes
about twice the steps a minute (495 in 3 minutes) and has 38 points of headroom there (seeds 1-5,
the README's shares night).

Each night is one `gbray round` command on the tiny student, `--threads 1`, its own recipe
otherwise. The one-trainer nights run two at a time (two processes, one thread each, on two
cores); a shares night has the machine to itself, one core per share: every run has one core per
trainer. Shares run on a `ray.cluster_utils.Cluster` of a head and one node per share, each one
CPU, launched with `--address`; each share's own adapter is examined beside the merge
(`--examine-shares`). The baseline (the raw student names no tool) is skipped everywhere.

Prints one JSON object: every night (result, turn-passes, each share's result and turn-passes,
the merge's syncs), per variant the means with their spread, the ratios, and the scaling
efficiency E = (shares - one at H) / (one at 2H - one at H): the part of what doubling the hours
gains that N machines get in the same hours.

    python benchmarks/shares_scaling.py                    # about 65 minutes on 2 cores
    python benchmarks/shares_scaling.py --minutes 2 --seeds 1   # a quick look

`--variants` compares ways of joining shares: `default` (`gbray round`'s own, no joining
flag: shares of equal speed step together, every step's gradients summed between them),
`apart` (`--no-step-together`: each share steps on its own turns, the average every sync),
`outer_lr:outer_momentum` (apart, the averager's outer optimizer, syncing every
`--sync-minutes`; `2:0 --sync-minutes 0.001` adds every share's step whole after each step),
`pool` (apart, `--pool-gradients`: the average every `--sync-minutes`, and at every step each
share steps on its own and the other's newest gradients), `together` (stepping together,
the group's post every `--sync-minutes`) or `end` (no syncs: `cat` at the end, the exact average
of the shares' updates). `--lockstep` adds the bound: N machines in lockstep.

`--bound steps` ends every night by its data instead of its time: one trainer at H trains a
slice of `--turns-at-h` turns (1,320: what one does in 3 minutes on 150-token pages on 2 cores
with AVX-512), at 2H twice that, N shares N times that between them, each three epochs, the
hours only a cap (`--cap-minutes`). The steps are then the same on any host, and a sync
lengthens a shares night instead of taking steps from it: the way of joining is measured
without the host's cost of a sync (on 2 cores two shares, the averager and three Ray nodes
share the CPU, and syncing after every step cost a third of the steps). The issue's measure is
`--bound time`, the default.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from gbray.settings import default_average_seconds

sys.path.insert(0, str(Path(__file__).parent))
from night_runs import (  # noqa: E402
    add_corpus_options,
    prepare,
    round_command,
    run_round,
    simulated_cluster,
    spread,
)

log = logging.getLogger("shares_scaling")


@dataclass(frozen=True)
class Bound:
    """What ends a night: its time (H minutes), or its data (`turns_at_h` turns for each H's
    worth of machine-hours, three epochs, `cap_minutes` only a cap)."""

    kind: str
    turns_at_h: int = 1320
    cap_minutes: float = 30.0

    def minutes(self, minutes: float) -> float:
        return minutes if self.kind == "time" else self.cap_minutes

    def flags(self, machine_hs: int) -> list[str]:
        """`machine_hs`: the night's machine-hours in H (one at 2H: 2; N shares at H: N)."""
        if self.kind == "time":
            return []
        return ["--turns", str(machine_hs * self.turns_at_h), "--epochs", "3"]

    def shares_flags(self, shares: int, minutes_h: float) -> list[str]:
        """A shares night's: its default sync interval follows its hours, so a night bound by
        its steps is told to sync as often as one of H minutes does (a variant's own interval,
        given after, wins)."""
        if self.kind == "time":
            return []
        every = default_average_seconds(minutes_h / 60) / 60
        return [*self.flags(shares), "--share-average-minutes", f"{every:g}"]

    @property
    def tag(self) -> str:
        """The nights' folder prefix: nights bound by their steps are kept apart."""
        return "" if self.kind == "time" else f"steps{self.turns_at_h}-"


def one_trainer(data, student, out: Path, minutes: float, seed: int, paper: int,
                *flags: str) -> dict:  # fmt: skip
    record = run_round(
        round_command(data, student, out, minutes, seed, paper, "--skip-baseline", *flags), out
    )
    return {
        "result_pct": record["result"]["agreement_pct"],
        "turn_passes": record["turn_passes"],
        "steps": record["steps"],
        "ended_by": record["why"],
        "lr": record["recipe"]["lr"],
        "accum": record["recipe"]["accum"],
    }


def lockstep(data, student, out: Path, minutes: float, seed: int, paper: int, machines: int,
             rate: float, accum: int, *flags: str) -> dict:  # fmt: skip
    """N machines in lockstep for `minutes / 2`, at no cost to sync: one trainer for `minutes`
    taking N times the turns a step (accumulated) at `rate`."""
    flags = ("--skip-baseline", "--accum", str(machines * accum), "--lr", f"{rate:.3g}", *flags)
    record = run_round(round_command(data, student, out, minutes, seed, paper, *flags), out)
    return {
        "result_pct": record["result"]["agreement_pct"],
        "turn_passes": record["turn_passes"],
        "steps": record["steps"],
        "ended_by": record["why"],
    }


def shares_night(data, student, out: Path, minutes: float, seed: int, paper: int, shares: int,
                 variant: str, sync_minutes: float, *flags: str) -> dict:  # fmt: skip
    if variant == "default":
        join = []
    elif variant == "apart":
        join = ["--no-step-together"]
    elif variant == "end":
        join = ["--share-average-minutes", "0"]
    elif variant == "pool":
        join = ["--share-average-minutes", str(sync_minutes), "--no-step-together",
                "--pool-gradients"]  # fmt: skip
    elif variant == "together":
        join = ["--share-average-minutes", str(sync_minutes)]
    else:
        lr, momentum = variant.split(":")
        join = ["--share-average-minutes", str(sync_minutes), "--no-step-together", "--outer-lr",
                lr, "--outer-momentum", momentum]  # fmt: skip
    if not (out / "round.json").is_file():
        cluster = simulated_cluster([f"worker{i}" for i in range(shares)])
        try:
            command = round_command(
                data, student, out, minutes, seed, paper, "--skip-baseline", *flags
            )
            run_round(
                [*command, "--address", cluster.address, "--shares", str(shares),
                 "--examine-shares", *join],
                out,
            )  # fmt: skip
        finally:
            cluster.shutdown()
    record = json.loads((out / "round.json").read_text())
    reports = record["share_reports"]
    merge = record.get("merge") or {}
    return {
        "result_pct": record["result"]["agreement_pct"],
        "turn_passes": sum((r["training"] or {}).get("turn_passes", 0) for r in reports),
        "shares_pct": [(r["exam"] or {}).get("agreement_pct") for r in reports],
        "shares_turn_passes": [(r["training"] or {}).get("turn_passes") for r in reports],
        "shares_steps": [(r["training"] or {}).get("steps") for r in reports],
        "shares_ended_by": [(r["training"] or {}).get("why") for r in reports],
        "merge": merge.get("method"),
        "syncs": len(merge.get("syncs", [])),
        "every_turns": merge.get("every_turns"),
        "pooled_turns": [(r["training"] or {}).get("pooled_turns") for r in reports],
        "grouped_syncs": sum(1 for s in merge.get("syncs", []) if s.get("grouped")),
        "grouped": [m.get("grouped") for m in merge.get("members", [])],
        "group_left": [m.get("group_left_why") for m in merge.get("members", [])],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--minutes", type=float, default=6.0, help="H, the night's hours in minutes")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--shares", type=int, nargs="+", default=[2],
                    help="share counts (one one-CPU node each; more than the cores is unfair)")  # fmt: skip
    ap.add_argument("--variants", nargs="+", default=["default"],
                    help="how shares join: default (gbray round's own flags: equal shares step "
                    "together), apart (--no-step-together: each steps alone, syncing), "
                    "outer_lr:outer_momentum every --sync-minutes (apart), pool (apart, the "
                    "average every --sync-minutes and every step's gradients pooled), "
                    "together (stepping together, the group's post every --sync-minutes), "
                    "or end (cat at the end)")  # fmt: skip
    ap.add_argument("--sync-minutes", type=float, default=0.15,
                    help="the fastest share's time between syncs")  # fmt: skip
    ap.add_argument("--lockstep", nargs="*", choices=["sqrt", "linear"], default=[],
                    help="also N machines in lockstep (one trainer for 2H, N times the turns a "
                    "step, the rate times sqrt(N) or N): what data parallelism gives without "
                    "syncing's costs, the bound of any way of joining the shares' turns")  # fmt: skip
    ap.add_argument("--bound", choices=["time", "steps"], default="time",
                    help="what ends each night: its time (H minutes; the issue's measure) or its "
                    "data (--turns-at-h turns a machine-H, three epochs; the steps the same on "
                    "any host, a sync's cost lengthening the night instead of taking steps)")  # fmt: skip
    ap.add_argument("--turns-at-h", type=int, default=1320,
                    help="with --bound steps: the slice one trainer at H trains")  # fmt: skip
    ap.add_argument("--cap-minutes", type=float, default=30.0,
                    help="with --bound steps: every night's hours, a cap the data should reach "
                    "first (each night's `ended_by` says)")  # fmt: skip
    ap.add_argument("--wording", default="alt", help="the corpus' wording (gbray synth --wording)")
    ap.add_argument("--tools", type=int, default=40, help="the corpus' tools (gbray synth --tools)")
    add_corpus_options(ap, turns=8000, work="/tmp/gbray-bench-scaling")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    data, student = prepare(
        args.work, args.turns, args.page_tokens, wording=args.wording, tools=args.tools
    )
    H = args.minutes
    ends = Bound(args.bound, args.turns_at_h, args.cap_minutes)
    tag = ends.tag
    started = time.monotonic()

    def single(job):
        minutes, seed = job
        night = one_trainer(data, student, args.work / f"{tag}one-{minutes:g}min-seed{seed}",
                            ends.minutes(minutes), seed, args.paper,
                            *ends.flags(round(minutes / H)))  # fmt: skip
        log.info("one trainer, %g min, seed %d: %.1f%% (%d turn-passes) [%.0f min in]", minutes,
                 seed, night["result_pct"], night["turn_passes"],
                 (time.monotonic() - started) / 60)  # fmt: skip
        return (minutes, seed), night

    with ThreadPoolExecutor(2) as pool:
        ones = dict(pool.map(single, [(m, s) for s in args.seeds for m in (2 * H, H)]))
    nights = []
    for seed in args.seeds:
        for n in args.shares:
            for variant in args.variants:
                name = f"{tag}shares{n}-{variant.replace(':', '_')}-{H:g}min-seed{seed}"
                night = shares_night(data, student, args.work / name, ends.minutes(H), seed,
                                     args.paper, n, variant, args.sync_minutes,
                                     *ends.shares_flags(n, H))  # fmt: skip
                night.update(seed=seed, shares=n, variant=variant)
                nights.append(night)
                log.info("%d shares (%s), seed %d: %.1f%%, shares %s [%.0f min in]", n, variant,
                         seed, night["result_pct"], night["shares_pct"],
                         (time.monotonic() - started) / 60)  # fmt: skip
    bound = {}
    if args.lockstep:

        def in_lockstep(job):
            n, rule, seed = job
            one = ones[(H, seed)]
            rate = one["lr"] * (n if rule == "linear" else n**0.5)
            name = f"{tag}lockstep{n}-{2 * H:g}min-seed{seed}" if rule == "linear" else (
                f"{tag}lockstep{n}-{rule}-{2 * H:g}min-seed{seed}"
            )  # fmt: skip
            night = lockstep(data, student, args.work / name, ends.minutes(2 * H), seed,
                             args.paper, n, rate, one["accum"], *ends.flags(n))  # fmt: skip
            log.info("%d machines in lockstep (%s rate), seed %d: %.1f%% (%d steps) [%.0f min in]",
                     n, rule, seed, night["result_pct"], night["steps"],
                     (time.monotonic() - started) / 60)  # fmt: skip
            return job, night

        jobs = [(n, rule, s) for n in args.shares for rule in args.lockstep for s in args.seeds]
        with ThreadPoolExecutor(2) as pool:
            bound = dict(pool.map(in_lockstep, jobs))
    one_h = [ones[(H, s)]["result_pct"] for s in args.seeds]
    one_2h = [ones[(2 * H, s)]["result_pct"] for s in args.seeds]
    gain = statistics.mean(one_2h) - statistics.mean(one_h)
    summary = {}
    for n in args.shares:
        for variant in args.variants:
            mine = [x for x in nights if x["shares"] == n and x["variant"] == variant]
            result = [x["result_pct"] for x in mine]
            best_share = [max(p for p in x["shares_pct"] if p is not None) for x in mine]
            passes = statistics.mean(x["turn_passes"] for x in mine) / statistics.mean(
                ones[(H, s)]["turn_passes"] for s in args.seeds
            )
            over_one = statistics.mean(result) - statistics.mean(one_h)
            efficiency = over_one / gain if gain > 0 else None
            summary[f"{n} shares, {variant}"] = {
                "result_pct": spread(result),
                "best_share_pct": spread(best_share),
                "minus_one_trainer_at_H_pct": round(over_one, 2),
                "scaling_efficiency_E": None if efficiency is None else round(efficiency, 3),
                "turn_passes_vs_one_trainer": round(passes, 3),
                "checks": {
                    "beats one trainer at H by >= 5 points": over_one >= 5,
                    "E >= 0.7": efficiency is not None and efficiency >= 0.7,
                    "mean >= the best share's mean": statistics.mean(result)
                    >= statistics.mean(best_share),
                    "turn-passes >= 1.8x one trainer's": passes >= 1.8,
                },
            }
    for n, rule in sorted({(n, rule) for n, rule, _ in bound}):
        result = [bound[(n, rule, s)]["result_pct"] for s in args.seeds]
        over_one = statistics.mean(result) - statistics.mean(one_h)
        summary[f"{n} machines in lockstep, {rule} rate"] = {
            "result_pct": spread(result),
            "steps": [bound[(n, rule, s)]["steps"] for s in args.seeds],
            "minus_one_trainer_at_H_pct": round(over_one, 2),
            "scaling_efficiency_E": round(over_one / gain, 3) if gain > 0 else None,
        }
    report = {
        "corpus": f"gbray synth --wording {args.wording} --turns {args.turns} --prompt-tokens "
        f"{args.page_tokens} --tools {args.tools}",
        "student": "tiny, pre-trained 450 steps",
        "minutes_H": H,
        "bound": args.bound,
        "turns_at_H": args.turns_at_h if args.bound == "steps" else None,
        "seeds": args.seeds,
        "sync_minutes": args.sync_minutes,
        "one_trainer": {
            "H": spread(one_h),
            "2H": spread(one_2h),
            "2H_minus_H_pct": round(gain, 2),
            "headroom (2H >= H + 10 points)": gain >= 10,
            "turn_passes_H": [ones[(H, s)]["turn_passes"] for s in args.seeds],
            "turn_passes_2H": [ones[(2 * H, s)]["turn_passes"] for s in args.seeds],
        },
        "shares_nights": nights,
        "summary": summary,
        "wall_minutes": round((time.monotonic() - started) / 60, 1),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
