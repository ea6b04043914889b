"""Where one training step of gbray's trainer spends its time: torch.profiler over one optimizer
step after a warm-up, on the same student and turns as train_speed.py, with the recipe's LoRA
dropout and without it (the one lever the profile shows that is a recipe choice, not a speed one).

    python benchmarks/train_profile.py --layers 6
    python benchmarks/train_profile.py --layers 6 --dropouts 0.05

Prints one JSON object: per dropout the step's seconds, the bytes its forwards kept for backward
over the step (the trainer's own measure; a step back-propagates each group of turns before the
next, so they were not all held at once) and the operators with the most self time; then their ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import train_speed  # noqa: E402  (the same student and turns)


def profile_step(args, model_dir: Path, dropout: float) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from gbray.tuning import SavedForBackward

    recipe = dataclasses.replace(train_speed.recipe_for(args, "gbray"), lora_dropout=dropout)
    trainer, choices, step = train_speed.gbray_step(
        args, recipe, model_dir, args.work / f"out-profile-{dropout}", args.accum
    )
    step()  # warm-up
    saved = SavedForBackward(trainer.model)
    with saved:
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        step()
        seconds = time.perf_counter() - started
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows) or 1
    return {
        "seconds_per_step": round(seconds, 2),
        "saved_for_backward_gb": round(saved.bytes / 1e9, 2),
        "choices": choices.as_dict(),
        "top_ops": [
            {"op": e.key, "share": round(e.self_cpu_time_total / total, 3), "calls": e.count}
            for e in rows[: args.top]
        ],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=24, help="decoder layers (24: the real shape)")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--answer-tokens", type=int, default=64)
    p.add_argument("--shared-tokens", type=int, default=1972, help="as in train_speed.py")
    p.add_argument("--accum", type=int, default=16, help="turns an optimizer step")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--work", type=Path, default=Path("/tmp/gbray-train-speed"))
    p.add_argument("--dropouts", default="0.05,0", help="LoRA dropouts to profile, comma-separated")
    p.add_argument("--top", type=int, default=8, help="operators listed per run")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model_dir = train_speed.student(args)
    runs = {d: profile_step(args, model_dir, float(d)) for d in args.dropouts.split(",")}
    out = {
        "benchmark": "train_profile",
        "layers": args.layers,
        "threads": args.threads,
        "runs": runs,
    }
    keys = list(runs)
    if len(keys) == 2:
        a, b = runs[keys[0]], runs[keys[1]]
        out["ratios"] = {
            f"seconds_{keys[0]}_vs_{keys[1]}": round(
                a["seconds_per_step"] / b["seconds_per_step"], 2
            ),
            f"saved_{keys[0]}_vs_{keys[1]}": round(
                a["saved_for_backward_gb"] / max(b["saved_for_backward_gb"], 1e-9), 2
            ),
        }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
