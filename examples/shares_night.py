"""A shares night driven from one script: N shares on a Ray cluster report to the hub, the owner
promotes the merge if it beat its baseline, and a trial of what then serves (a fresh exam in a
process of its own) checks that it scores what its round recorded.

    python examples/shares_night.py --address auto --shares 2 --hub https://hub:8600 \\
        --device-token $GB_TOKEN --owner-token $OWNER --model students/tiny --data corpus \\
        --out rounds/tonight --hours 6

`--recipe '{"lr": 1e-3, ...}'` sets any `gbray round` recipe field (`gbray round --help`); the
student's own recipe fills the rest. Prints one JSON line per step and exits 1 if the night
failed or what serves does not score what its round recorded (within one turn).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from gbray.api import Recipe, RoundSettings, night, promote, trial
from gbray.settings import student_hints


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--address", default="auto", help="the Ray cluster (default auto)")
    ap.add_argument("--shares", type=int, default=2)
    ap.add_argument("--hub", required=True)
    ap.add_argument("--device-token", required=True, help="the token the shares report with")
    ap.add_argument("--owner-token", required=True, help="an owner's token, to promote")
    ap.add_argument("--ca", type=Path, help="the hub's certificate authority, if its own")
    ap.add_argument("--model", required=True, help="the student")
    ap.add_argument("--data", type=Path, help="the corpus, where the hub cannot be reached")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--hours", type=float, default=6.0)
    ap.add_argument("--recipe", default="{}", help="recipe fields as JSON")
    args = ap.parse_args()
    # The night's progress lines (each also goes to the hub, and to OUT/progress.log).
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    hub = {"hub": args.hub, "token": args.device_token, "ca": args.ca}
    recipe = Recipe(**{**student_hints(args.model, args.hours), "hours": args.hours,
                       **json.loads(args.recipe)})  # fmt: skip
    done = night(
        RoundSettings(model=args.model, data=args.data, out=args.out, address=args.address,
                      shares=args.shares, examine_shares=True, recipe=recipe, **hub)
    )  # fmt: skip
    print(json.dumps({"night": done.hub_round, "status": done.status, "baseline": done.baseline_pct,
                      "result": done.result_pct, "beat": done.beat}))  # fmt: skip
    if done.status != "done":
        return 1
    if done.beat and done.hub_round:
        answer = promote(args.hub, args.owner_token, done.hub_round, ca=args.ca)
        print(json.dumps({"promoted": answer.promoted, "refused": answer.refused}))
    tried = trial(
        RoundSettings(model=args.model, out=args.out / "trial", address=args.address,
                      adapter="hub:serving", recipe=recipe, **hub)
    )  # fmt: skip
    serving = tried.record.get("serving") or {}
    print(json.dumps({"trial_of": tried.candidate, "serving_round": serving.get("round"),
                      "trial": tried.result_pct, "its_round_recorded": serving.get("result")}))  # fmt: skip
    right = tried.record["result"]["right"] if tried.record.get("result") else None
    if serving.get("round") == done.hub_round:
        recorded = done.record["result"]["right"]
        return 0 if right is not None and abs(right - recorded) <= 1 else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
