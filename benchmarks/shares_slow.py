"""What a slow machine's share does to the night's adapter. Two shares on a simulated cluster of
one-CPU nodes (a head with no CPU, two workers), one of them slowed by a pause per turn (a sleep,
no CPU taken: about a ninth of the other's speed here), one-minute nights that are time-bound,
the shares syncing every 6 s (`--sync-minutes`). The baseline, in the same run: the same two
machines training apart (no syncs; `cat` joins them at the end, weighted by their turns, so the
merge is about the fast share's adapter).

A learnable corpus (14 tools, 180-token pages) and student (pre-trained 420 steps), a
150-turn paper. Prints JSON: each night's merge and each share's own adapter on the paper, the
turn-passes, the slow share's syncs (staleness, freshness, weight), per variant the mean over
the seeds, and each variant's merge over the apart nights'. `--variants ... pooled` adds
nights that also pool every step's gradients (`--pool-gradients`).

    python benchmarks/shares_slow.py                 # seeds 1 2 3, about 10 minutes on 2 cores
    python benchmarks/shares_slow.py --variants apart synced pooled   # about 15 minutes
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from night_runs import prepare_learnable, simulated_cluster  # noqa: E402

log = logging.getLogger("shares_slow")
VARIANTS = ("apart", "synced", "pooled")


def night(data: Path, student: Path, out: Path, seed: int, paper: int, every: float, pause: float,
          pool: bool = False):  # fmt: skip
    from gbray.round import run_round
    from gbray.settings import Recipe, RoundSettings

    recipe = Recipe(
        hours=1.0 / 60, epochs=50, turns=240, lr=3e-3, batch=4, accum=1, lora_r=8, lora_alpha=16,
        max_len=384, val_turns=16, val_every_minutes=0.3, last_every_minutes=0.1,
        progress_every_minutes=0.1, exam_turns=paper, answer_budget=24, seed=seed, threads=1,
        gradient_checkpointing=False, precision="float32",
    )  # fmt: skip
    slow = {"runtime_env": {"env_vars": {"GBRAY_SIMULATED_SLOWDOWN": str(pause)}}}
    record = run_round(
        RoundSettings(
            data=data, model=str(student), out=out, shares=2, share_options=({}, slow),
            skip_baseline=True, examine_shares=True, recipe=recipe, share_average_minutes=every,
            pool_gradients=pool,
        )
    )  # fmt: skip
    reports = record["share_reports"]
    syncs = (record.get("merge") or {}).get("syncs", [])
    return {
        "merge_pct": record["result"]["agreement_pct"],
        "shares_pct": [r["exam"]["agreement_pct"] for r in reports],
        "turn_passes": [r["training"]["turn_passes"] for r in reports],
        "pooled_turns": [r["training"].get("pooled_turns") for r in reports],
        "slow_share_syncs": [
            {k: s.get(k) for k in ("turns", "staleness", "freshness", "weight", "final")}
            for s in syncs
            if s["share"] == 1
        ],
    }


def main() -> None:
    import ray

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--paper", type=int, default=150, help="the paper's turns")
    ap.add_argument(
        "--sync-minutes", type=float, default=0.1, help="the fast share's sync interval"
    )
    ap.add_argument("--pause", type=float, default=0.4, help="the slow share's pause a turn, s")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=["apart", "synced"],
                    help="apart (no syncs, cat at the end: the baseline), synced (the average "
                    "every --sync-minutes), pooled (synced, and --pool-gradients)")  # fmt: skip
    ap.add_argument("--work", type=Path, default=Path("/tmp/gbray-bench-slow"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    data, student = prepare_learnable(args.work)
    started = time.monotonic()
    cluster = simulated_cluster(["fast", "slow"], head_cpus=0)
    nights = []
    try:
        ray.init(address=cluster.address)
        for seed in args.seeds:
            for variant in args.variants:
                out = args.work / f"{variant}-seed{seed}"
                every = 0.0 if variant == "apart" else args.sync_minutes
                row = night(data, student, out, seed, args.paper, every, args.pause,
                            pool=variant == "pooled")  # fmt: skip
                row.update(variant=variant, seed=seed)
                nights.append(row)
                log.info("%s, seed %d: merge %.1f%%, shares %s [%.0f min in]", variant, seed,
                         row["merge_pct"], row["shares_pct"], (time.monotonic() - started) / 60)  # fmt: skip
    finally:
        ray.shutdown()
        cluster.shutdown()
    means = {
        v: round(statistics.mean(n["merge_pct"] for n in nights if n["variant"] == v), 2)
        for v in args.variants
    }
    print(
        json.dumps(
            {
                "corpus": "gbray synth --turns 2500 --prompt-tokens 180 --tools 14 --seed 11",
                "student": "tiny, pre-trained 420 steps",
                "paper": args.paper,
                "nights": nights,
                "merge_pct_mean": means,
                "over_apart": {v: round(m / means["apart"], 3) for v, m in means.items()}
                if "apart" in means
                else {},
                "wall_minutes": round((time.monotonic() - started) / 60, 1),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
