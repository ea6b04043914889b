"""A 2-share round on a simulated 3-node cluster, once per averaging interval, on a corpus the
student never saw while pre-training (other wording): how the merge compares with its shares.

Each interval is one `gbray round --shares 2 --examine-shares` command (3 minutes of training,
a 100-turn paper); the baseline is the same round with averaging off (`0`), measured in the
same run. Prints one JSON object: per interval the baseline exam, the merge's and each share's
agreement, and how often each share averaged.

    python benchmarks/shares_average.py --every 0 0.25 0.05

The corpus and the student (14 tools, 180-token pages, pre-trained a fixed 420 steps: the test
suite's `learnable` student of its time, on the other wording) are built once under --work.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from night_runs import prepare_learnable, simulated_cluster  # noqa: E402


def night(data: Path, student: Path, out: Path, every: str) -> dict:
    cluster = simulated_cluster(["laptop", "desktop"])
    try:
        run = subprocess.run(
            [
                sys.executable, "-m", "gbray.cli", "round", "--address", cluster.address,
                "--shares", "2", "--examine-shares", "--data", str(data), "--model", str(student),
                "--out", str(out), "--hours", "0.05", "--epochs", "4", "--turns", "1600",
                "--lr", "3e-3", "--batch", "8", "--accum", "1", "--lora-r", "16",
                "--lora-alpha", "32", "--max-len", "512", "--val-every-minutes", "0.5",
                "--exam-turns", "100", "--answer-budget", "24", "--seed", "5", "--threads", "1",
                "--no-gradient-checkpointing", "--share-average-minutes", every,
            ],
            capture_output=True, text=True,
        )  # fmt: skip
    finally:
        cluster.shutdown()
    if run.returncode != 0:
        raise SystemExit(
            f"the round for --share-average-minutes {every} failed:\n{run.stderr[-3000:]}"
        )
    record = json.loads((out / "round.json").read_text())
    return {
        "share_average_minutes": float(every),
        "baseline_pct": record["baseline"]["agreement_pct"],
        "merged_pct": record["result"]["agreement_pct"],
        "shares_pct": [r["exam"]["agreement_pct"] for r in record["share_reports"]],
        "averaged": [r["training"]["averaged"] for r in record["share_reports"]],
        "steps": [r["training"]["steps"] for r in record["share_reports"]],
        "split": record["share_split"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--every", nargs="+", default=["0", "0.25", "0.05"],
                    help="averaging intervals in minutes; 0 (off) is the baseline")  # fmt: skip
    ap.add_argument("--work", type=Path, default=Path("/tmp/gbray-bench-shares"))
    args = ap.parse_args()
    data, student = prepare_learnable(args.work, wording="alt")
    runs = [night(data, student, args.work / f"night-{every}", every) for every in args.every]
    off = next((r for r in runs if r["share_average_minutes"] == 0), None)
    for r in runs:
        r["merged_minus_best_share"] = r["merged_pct"] - max(r["shares_pct"])
        if off is not None:
            r["merged_vs_no_averaging"] = round(r["merged_pct"] / max(off["merged_pct"], 1e-9), 3)
    print(json.dumps({"corpus": "other wording, 14 tools", "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
