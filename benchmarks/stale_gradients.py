"""What one step of staleness costs: why shares that never wait trail two machines in lockstep.

Two machines in lockstep take each step on both machines' turns, every gradient computed at the
same weights. Shares that never wait can at best take the other machine's newest gradient, which
was computed a step earlier (`--pool-gradients`). This runs one trainer, in one process, both
ways on the README's shares night (the tiny student, `gbray synth --wording alt
--prompt-tokens 150`, 40 tools), with no Ray, no clock and no host in it:

- `fresh`: each step on 16 turns, two groups of 8, both gradients at the current weights (the
  lockstep; the groups are the two halves of the slice, as two shares would hold them);
- `stale`: each step on the first group's gradient at the current weights and the second group's
  gradient of the step before, computed at the weights of the step before (what a share pooling
  with a partner that never waits gets at best).

- `lagged`: the second group's turns of the step before, as `stale` takes them, but their
  gradient computed at the current weights: it tells the age of the weights from the lag of the
  turns.
- `alone`: one machine: each step on the first group only, at the recipe's rate.

`fresh`, `stale` and `lagged` take the same turns at the same rate (the recipe's, times sqrt(2) for
the doubled batch, constant after no warm-up); `stale` and `lagged` take the very same turns in the
same order, so what differs between them is only the weights half of each step's gradient was
computed at. Prints one JSON object: each seed's validation loss after `--steps` steps each way,
the means, and the part of the fresh step's gain over one machine alone that the stale and the
lagged steps keep.

    python benchmarks/stale_gradients.py                  # about 12 minutes on 2 cores
    python benchmarks/stale_gradients.py --seeds 1 --steps 60 --ways alone stale
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from night_runs import add_corpus_options, prepare  # noqa: E402

from gbray.data.fit import make_examples  # noqa: E402
from gbray.data.turns import index_folder  # noqa: E402
from gbray.settings import Recipe  # noqa: E402
from gbray.trainer import Trainer, TrainState  # noqa: E402
from gbray.work import local_work  # noqa: E402

log = logging.getLogger("stale_gradients")
WAYS = ("alone", "fresh", "stale", "lagged")


def seed_recipe(seed: int, steps: int) -> Recipe:
    """The tiny student's recipe (its own hints), with a slice of two groups a step."""
    return Recipe(lr=1e-3, batch=8, accum=1, max_len=1024, threads=2, precision="float32",
                  seed=seed, turns=16 * steps + 16, val_turns=64, hours=1.0, exam_turns=150)  # fmt: skip


def trained_loss(
    student: Path, work: Path, recipe: Recipe, work_items, steps: int, way: str
) -> float:
    """The validation loss after `steps` steps taken `way` (one of WAYS) on the seed's slice."""
    trainer = Trainer(str(student), None, recipe, work / f"{way}-{recipe.seed}",
                      report=lambda _line: None)  # fmt: skip
    trainer.configure(recipe.max_len)
    examples, _ = make_examples(trainer.tokenizer, work_items.train, recipe.max_len,
                                recipe.answer_room)  # fmt: skip
    val, _ = make_examples(trainer.tokenizer, work_items.val, recipe.max_len, recipe.answer_room)
    half = len(examples) // 2
    first, second = examples[:half], examples[half:]
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    state, before = TrainState(), None
    for step in range(steps):
        group = slice(step * recipe.batch, (step + 1) * recipe.batch)
        if way == "alone":
            trainer.accumulate([first[group]], state)
            trainer.optimizer_step(state, recipe.lr)
            continue
        # `stale` and `lagged` both take the second group's turns of the step before (its
        # first turns twice, at steps 0 and 1), `fresh` this step's.
        lag = slice(max(step - 1, 0) * recipe.batch, max(step, 1) * recipe.batch)
        trainer.accumulate([second[lag if way == "lagged" else group]], state)
        now = [p.grad.clone() for p in params]
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.accumulate([first[group]], state)
        taken = before if way == "stale" and before is not None else now
        for p, g in zip(params, taken, strict=True):
            p.grad.add_(g).mul_(0.5)
        before = now
        trainer.optimizer_step(state, recipe.lr * math.sqrt(2))
    return trainer.validation_loss(val)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=120, help="optimizer steps of 16 turns")
    ap.add_argument(
        "--ways",
        nargs="+",
        choices=WAYS,
        default=list(WAYS),
        help="which ways to train (deterministic: a way's figures do not depend on the others run)",
    )
    ap.add_argument("--wording", default="alt")
    ap.add_argument("--tools", type=int, default=40)
    add_corpus_options(ap, turns=8000, work="/tmp/gbray-bench-scaling", page_tokens=150)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    data, student = prepare(
        args.work, args.turns, args.page_tokens, wording=args.wording, tools=args.tools
    )
    began = time.monotonic()
    runs = []
    for seed in args.seeds:
        recipe = seed_recipe(seed, args.steps)
        work_items = local_work(data, *index_folder(data), recipe, with_slice=True)
        loss = {way: trained_loss(student, args.work / "stale", recipe, work_items, args.steps, way)
                for way in args.ways}  # fmt: skip
        runs.append({"seed": seed, **{way: round(v, 4) for way, v in loss.items()}})
        log.info("seed %d: %s [%.1f min in]", seed, runs[-1], (time.monotonic() - began) / 60)
    means = {way: statistics.mean(r[way] for r in runs) for way in args.ways}
    print(json.dumps({
        "steps": args.steps,
        "runs": runs,
        **{f"{way}_mean": round(v, 4) for way, v in means.items()},
        **kept_of_gain(means),
        "wall_minutes": round((time.monotonic() - began) / 60, 1),
    }, indent=2))  # fmt: skip


def kept_of_gain(means: dict[str, float]) -> dict[str, float]:
    """What the second machine's turns buy each way: the part of the fresh step's gain over one
    machine alone that the stale and the lagged steps keep (where those ways ran)."""
    gain = means.get("alone", 0.0) - means.get("fresh", 0.0)
    if "alone" not in means or "fresh" not in means or not gain:
        return {}
    return {f"{way}_keeps_of_gain": round((means["alone"] - means[way]) / gain, 3)
            for way in ("stale", "lagged") if way in means}  # fmt: skip


if __name__ == "__main__":
    main()
