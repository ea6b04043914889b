"""A week of nights on one hub: K nights through an embedded hub started with `--auto-promote`,
each a `gbray round --adapter hub:serving` (it starts from what serves when it starts, and only a
round that passes the gate replaces it), then a `gbray trial --adapter hub:serving` in a process
of its own: does what serves score what its round recorded?

The corpus is `gbray synth --wording alt` (its 300-token pages, 40 tools) loaded into the hub, which
hands each night a slice of turns no night has taken; the tiny student, pre-trained 450 steps;
a 150-turn paper; `--threads 1`. The gate is the hub's `--auto-promote` default: beat its own
baseline, above what serves on the paper, significance (exact McNemar p < 0.05) and no fallen tool.

Prints one JSON object: per night its start, baseline, result, the hub's decision (and the rule
that refused it), and what serves after it; the serving curve; the trial beside its round.

    python benchmarks/nights.py                        # 5 nights of 3 minutes: about 15 minutes
    python benchmarks/nights.py --nights 3 --page-tokens 500   # pages where 3 minutes stall
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).parent))
from night_runs import (  # noqa: E402
    add_corpus_options,
    prepare,
    round_command,
    run_round,
    trial_command,
)

from gbray.hub.gate import UNATTENDED, GateRules  # noqa: E402
from gbray.hub.server import EmbeddedHub, HubSettings, free_port  # noqa: E402
from gbray.hub.store import Store  # noqa: E402

log = logging.getLogger("nights")


def start_hub(work: Path, data: Path) -> tuple[EmbeddedHub, str, str]:
    """A fresh hub under `work` with the corpus loaded; returns it, an owner and a device token."""
    root = work / f"hub-{time.strftime('%H%M%S')}"
    store = Store(root / "hub.db")
    store.load(data / "train.jsonl", data / "eval.jsonl")
    owner, device = store.add_token("owner", owner=True), store.add_token("laptop", owner=False)
    settings = HubSettings(
        db=root / "hub.db", store=root / "store", port=free_port(), auto_promote=True,
        gate=GateRules(**UNATTENDED),
    )  # fmt: skip
    return EmbeddedHub(settings).start(), owner, device


def state(hub: EmbeddedHub, owner: str) -> dict:
    r = requests.get(
        hub.url + "/v1/training/state", headers={"Authorization": f"Bearer {owner}"}, timeout=30
    )
    r.raise_for_status()
    return r.json()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--nights", type=int, default=5)
    ap.add_argument("--minutes", type=float, default=3.0, help="each night's hours, in minutes")
    ap.add_argument("--seed", type=int, default=1, help="the first night's seed (then +1 each)")
    add_corpus_options(ap, turns=8000, work="/tmp/gbray-bench-nights", page_tokens=300)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    data, student = prepare(args.work, args.turns, args.page_tokens, wording="alt")
    hub, owner, device = start_hub(args.work, data)
    began = time.monotonic()
    hub_flags = ["--hub", hub.url, "--token", device, "--adapter", "hub:serving"]
    nights = []
    try:
        for k in range(args.nights):
            out = args.work / f"night-{k + 1}-{time.strftime('%H%M%S')}"
            command = round_command(
                data, student, out, args.minutes, args.seed + k, args.paper, *hub_flags
            )
            record = run_round(command, out)
            seen = state(hub, owner)
            decision = next(
                (d for d in seen["decisions"] if d["round"] == record["hub_round"]), None
            )
            serving = seen["serving"]
            nights.append(
                {
                    "night": k + 1,
                    "round": record["hub_round"],
                    "start": record["start"],
                    "baseline_pct": (record["baseline"] or {}).get("agreement_pct"),
                    "result_pct": (record["result"] or {}).get("agreement_pct"),
                    "promoted": decision["promoted"] if decision else None,
                    "why": decision["why"] if decision else "not put to the gate",
                    "serving_after": serving and serving["round"],
                    "serving_after_pct": serving and serving["result"],
                }
            )
            log.info("night %d: %s -> %s%% (%s); serving %s at %s%% [%.0f min in]", k + 1,
                     nights[-1]["start"], nights[-1]["result_pct"],
                     "promoted" if decision and decision["promoted"] else nights[-1]["why"][:80],
                     nights[-1]["serving_after"], nights[-1]["serving_after_pct"],
                     (time.monotonic() - began) / 60)  # fmt: skip
        trial_out = args.work / f"trial-{time.strftime('%H%M%S')}"
        trial = None
        if state(hub, owner)["serving"]:
            command = trial_command(student, trial_out, args.paper, *hub_flags)
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"the trial failed:\n{done.stderr[-3000:]}")
            trial = json.loads((trial_out / "trial.json").read_text())
    finally:
        hub.stop()
    serving_curve = [n["serving_after_pct"] for n in nights]
    recorded = next((n["result_pct"] for n in nights if n["round"] == (trial or {}).get(
        "serving", {}).get("round")), None)  # fmt: skip
    report = {
        "corpus": f"gbray synth --wording alt --turns {args.turns} --prompt-tokens "
        f"{args.page_tokens} (40 tools)",
        "student": "tiny, pre-trained 450 steps",
        "minutes_per_night": args.minutes,
        "gate": "--auto-promote (beat its baseline, above what serves, p < 0.05, no fallen tool)",
        "nights": nights,
        "serving_after_each_night_pct": serving_curve,
        "promotions": sum(1 for n in nights if n["promoted"]),
        "trial_of_serving": None
        if trial is None
        else {
            "candidate": trial["candidate"],
            "trial_pct": trial["result"]["agreement_pct"],
            "its_round_recorded_pct": recorded,
        },
        "wall_minutes": round((time.monotonic() - began) / 60, 1),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
