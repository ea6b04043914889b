"""Does a longer night make a better adapter? The hours curve: nights of H, 2H and 4H minutes
(H = 3 by default), seeds 1 2 3, each with the chosen schedule and with the one nights had
before, in the same run:

- `wsd` (chosen, gbray's defaults): warm-up, the peak held, a cool-down over the night's last
  fifth or from a plateau; the adapter kept by validation agreement; the tiny student's own
  rate (1e-3).
- `cosine` (before): cosine fitted to the time, a plateau ends the night, the adapter kept by
  validation loss, at the tiny student's former rate (3e-3).
- `schedule-free` (measured, not chosen; `pip install schedulefree`): Schedule-Free AdamW at the
  student's rate, the adapter its running average; a plateau ends the night.

Each night is one `gbray round` command on the tiny student with `--threads 1` and no recipe flag
but its variant's: the student's own recipe, as a new user runs it. Nights run two at a time
(two processes, one thread each, on two cores), the variants of one seed and length side by
side, so they share whatever else the machine is doing. The corpus is `gbray synth` with
500-token pages (40 tools; on 300-token pages both 6- and 12-minute nights reached the 95% the
paper's silver labels allow, where a longer night can only tie) and more training turns than the
longest night takes.

Prints one JSON object: every night (result, baseline, kept step and its phase, why it ended,
steps, turn-passes), per variant the mean result at each length with its spread, and the
issue's checks: 2H >= H + 3 points, 4H >= 2H on the means, and no seed's longer night more than
two turns below its shorter night.

    python benchmarks/hours_curve.py                      # about 70 minutes on 2 cores
    python benchmarks/hours_curve.py --minutes 1 --seeds 1 --doublings 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from night_runs import add_corpus_options, prepare, round_command, run_round, spread  # noqa: E402

# What each variant means here: the flags a night adds to the student's own recipe.
SCHEDULES = {
    "wsd": ["--schedule", "wsd", "--keep-by", "agreement"],
    "cosine": ["--schedule", "cosine", "--keep-by", "loss", "--lr", "3e-3"],
    "schedule-free": ["--schedule", "schedule-free", "--keep-by", "agreement"],
}
DEFAULT = ["wsd", "cosine"]


def night(data: Path, student: Path, out: Path, minutes: float, seed: int, schedule: str,
          paper: int) -> dict:  # fmt: skip
    record = run_round(
        round_command(data, student, out, minutes, seed, paper, *SCHEDULES[schedule]), out
    )
    kept = next((c for c in record.get("checks", []) if c["step"] == record["best_step"]), {})
    return {
        "schedule": schedule,
        "minutes": minutes,
        "seed": seed,
        "result_pct": record["result"]["agreement_pct"],
        "baseline_pct": record["baseline"]["agreement_pct"],
        "paper_turns": record["result"]["turns"],
        "why": record["why"],
        "steps": record["steps"],
        "kept_step": record["best_step"],
        "kept_phase": kept.get("phase"),
        "kept_val_agreement": record.get("best_val_agreement"),
        "kept_val_loss": record["best_val_loss"],
        "cooldown": (record.get("schedule") or {}).get("cooldown_why"),
        "turn_passes": record["turn_passes"],
        "training_minutes": record["training_minutes"],
    }


def summary(nights: list[dict], lengths: list[float], turn_pct: float) -> dict:
    out = {}
    for schedule in sorted({n["schedule"] for n in nights}):
        mine = [n for n in nights if n["schedule"] == schedule]
        means, rows = [], {}
        for m in lengths:
            results = [n["result_pct"] for n in mine if n["minutes"] == m]
            means.append(statistics.mean(results))
            rows[f"{m:g} min"] = spread(results)
        worst = min(
            (
                longer["result_pct"] - shorter["result_pct"]
                for shorter in mine
                for longer in mine
                if longer["seed"] == shorter["seed"] and longer["minutes"] == 2 * shorter["minutes"]
            ),
            default=None,
        )
        out[schedule] = {
            "by_length": rows,
            "first_doubling_gain_pct": round(means[1] - means[0], 2) if len(means) > 1 else None,
            "each_doubling_gain_pct": [
                round(b - a, 2) for a, b in zip(means, means[1:], strict=False)
            ],
            "worst_seed_doubling_pct": None if worst is None else round(worst, 2),
            "checks": {
                "2H >= H + 3 points": len(means) > 1 and means[1] >= means[0] + 3,
                "4H >= 2H (each doubling after the first)": all(
                    b >= a for a, b in zip(means[1:], means[2:], strict=False)
                ),
                "no seed's longer night two turns below": worst is None or worst >= -2 * turn_pct,
            },
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--minutes", type=float, default=3.0, help="H, the shortest night")
    ap.add_argument("--doublings", type=int, default=2, help="nights of H, 2H, ... up to H*2^this")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--schedules", nargs="+", default=DEFAULT, choices=list(SCHEDULES))
    ap.add_argument("--parallel", type=int, default=2, help="nights run at once, one thread each")
    add_corpus_options(ap, turns=20_000, work="/tmp/gbray-bench-hours")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    data, student = prepare(args.work, args.turns, args.page_tokens, eval_turns=600)
    lengths = [args.minutes * 2**k for k in range(args.doublings + 1)]
    jobs = [
        (m, seed, schedule)
        for m in reversed(lengths)  # the longest first: the pool ends on short nights
        for seed in args.seeds
        for schedule in args.schedules
    ]
    started = time.monotonic()

    def run(job):
        m, seed, schedule = job
        out = args.work / f"night-{schedule}-{m:g}min-seed{seed}"
        done = night(data, student, out, m, seed, schedule, args.paper)
        print(
            f"{schedule} {m:g} min seed {seed}: {done['result_pct']:.1f}% ({done['why']}, "
            f"kept step {done['kept_step']} of {done['steps']}) "
            f"[{(time.monotonic() - started) / 60:.0f} min in]",
            file=sys.stderr,
            flush=True,
        )
        return done

    with ThreadPoolExecutor(args.parallel) as pool:
        nights = list(pool.map(run, jobs))
    nights.sort(key=lambda n: (n["schedule"], n["minutes"], n["seed"]))
    turn_pct = 100 / args.paper
    report = {
        "corpus": f"gbray synth --turns {args.turns} --prompt-tokens {args.page_tokens} (40 tools)",
        "student": "tiny, pre-trained 450 steps",
        "lengths_minutes": lengths,
        "seeds": args.seeds,
        "nights": nights,
        "summary": summary(nights, lengths, turn_pct),
    }
    if {"wsd", "cosine"} <= set(args.schedules):
        report["wsd_minus_cosine_pct"] = {
            f"{m:g} min": round(
                report["summary"]["wsd"]["by_length"][f"{m:g} min"]["mean"]
                - report["summary"]["cosine"]["by_length"][f"{m:g} min"]["mean"],
                2,
            )
            for m in lengths
        }
    report["wall_minutes"] = round((time.monotonic() - started) / 60, 1)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
