"""The fast exam against plain one-turn-at-a-time generation, same student and paper, one run.

The fast exam is the round's (batches of similar lengths, the shared prompt prefix cached once,
each answer ending once it names a complete tool); the baseline is plain `generate()` over each
whole prompt with the whole answer budget (320 tokens), one turn at a time. Prints one JSON
object: turns per minute of each, their ratio, whether every turn's tool matched, and every
near-tie (a step whose two best logits were closer than --tie-margin) with its margin.

    python benchmarks/exam_speed.py --size qwen2.5-0.5b-shape      # ~66 min here, plain ~61 of them
    python benchmarks/exam_speed.py --size tiny --turns 64 --prompt-tokens 700 --system-tokens 500

The round's exam batch against others, same paper and run, no plain side (`--against 16 64
--no-plain`): on the 0.5B shape (random weights: every answer runs the whole budget) and on a
trained SmolLM2 (`--student S --adapter A --data D --turns 120 --budget 96 --max-len 1024`).

Without --student and --data it builds what it needs under --work (kept for the next run): a
synthetic corpus with turns of about --prompt-tokens, and the student (`tiny` pre-trained
briefly; `qwen2.5-0.5b-shape` random weights at the real student's dimensions).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

from gbray.data.fit import fit_prompt
from gbray.data.synth import SynthSettings, write_corpus
from gbray.data.turns import index_folder
from gbray.examiner import Examiner
from gbray.settings import ExamMode, Recipe
from gbray.student import StudentSettings, build_student
from gbray.work import paper_of


def prepare(args) -> tuple[Path, Path]:
    shape = f"{args.prompt_tokens}-{args.system_tokens}"
    data = args.data or args.work / f"data-{shape}"
    if not (data / "eval.jsonl").is_file():
        write_corpus(
            SynthSettings(
                out=data, turns=400, eval_turns=200, seed=3, prompt_tokens=args.prompt_tokens,
                system_tokens=args.system_tokens,
            )
        )  # fmt: skip
    student = args.student or args.work / f"student-{args.size}-{shape}"
    if not (student / "config.json").is_file():
        build_student(
            StudentSettings(
                data=data,
                out=student,
                size=args.size,
                pretrain_steps=450 if args.size == "tiny" else 0,
                pretrain_max_len=min(1024, args.max_len),
            )
        )
    return data, student


def timed(examiner: Examiner, prompts: list[list[int]], budget: int, mode: ExamMode):
    started = time.perf_counter()
    answers = examiner.answers(prompts, budget, mode)
    seconds = time.perf_counter() - started
    return answers, {
        "seconds": round(seconds, 2),
        "turns_per_minute": round(60 * len(prompts) / seconds, 3),
        "rows_per_batch": examiner.rows,
        "generated_tokens": sum(len(a.tokens) for a in answers),
    }


def divergence(fast, plain) -> int:
    return next(
        (k for k, (x, y) in enumerate(zip(fast.tokens, plain.tokens, strict=False)) if x != y),
        min(len(fast.tokens), len(plain.tokens)),
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", default="tiny", choices=("tiny", "qwen2.5-0.5b-shape"))
    p.add_argument("--student", type=Path, help="a student folder (default: built under --work)")
    p.add_argument("--data", type=Path, help="a data folder (default: built under --work)")
    p.add_argument("--work", type=Path, default=Path("/tmp/gbray-exam-speed"))
    p.add_argument("--prompt-tokens", type=int, default=2700, help="about how long a turn is")
    p.add_argument(
        "--system-tokens", type=int, default=2600,
        help="about how long the shared system prompt (the tool catalogue) is; the field's was "
        "about 2,600 tokens of 2,700",
    )  # fmt: skip
    p.add_argument("--turns", type=int, default=64, help="turns on the paper")
    p.add_argument(
        "--batch", type=int, default=Recipe.exam_batch,
        help="the fast exam's batch, the round's default (--exam-batch) (default %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--against", type=int, nargs="*", default=[],
        help="other batches to time the fast exam at in the same run, e.g. 16 64",
    )  # fmt: skip
    p.add_argument("--adapter", type=Path, help="a trained adapter on --student")
    p.add_argument(
        "--no-plain", action="store_true",
        help="skip the one-turn-at-a-time side (an hour on the 0.5B shape)",
    )  # fmt: skip
    p.add_argument("--budget", type=int, default=320, help="the answer budget")
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--tie-margin", type=float, default=1e-4)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    data, student = prepare(args)
    _, evaluation = index_folder(data)
    paper, paper_id = paper_of(evaluation, args.turns)
    examiner = Examiner(
        str(student), str(args.adapter) if args.adapter else None, "float32", args.threads, "cpu"
    )
    room = args.max_len - min(args.budget, args.max_len // 2)
    prompts = [fit_prompt(examiner.tokenizer, t["system"], t["user"], room)[0] for t in paper]

    fast_mode = ExamMode(batch=args.batch, tie_margin=args.tie_margin)
    # Untimed: a process's first forwards pay for allocation and kernel choice (the first timed
    # exam of a run was 12-24% slower than the same exam again).
    examiner.answers(prompts[:16], args.budget, fast_mode)
    fast, fast_figures = timed(examiner, prompts, args.budget, fast_mode)
    prefix = examiner.prefix_tokens
    batches = {}
    for batch in args.against:
        answers, figures = timed(examiner, prompts, args.budget, ExamMode(batch=batch))
        batches[batch] = {
            **figures,
            "default_over_this": round(fast_figures["seconds"] / figures["seconds"], 3),
            "same_tools": [a.tool for a in answers] == [a.tool for a in fast],
        }
    report = {
        "benchmark": "exam_speed",
        "student": str(student),
        "adapter": str(args.adapter) if args.adapter else None,
        "size": args.size,
        "paper": paper_id,
        "turns": len(paper),
        "prompt_tokens_mean": round(statistics.mean(len(x) for x in prompts)),
        "prefix_tokens": prefix,
        "answer_tokens_mean": round(statistics.mean(len(a.tokens) for a in fast), 1),
        "batch": args.batch,
        "answer_budget": args.budget,
        "threads": examiner.threads,
        "fast": fast_figures,
        "right": sum(a.tool == t["tool"] for a, t in zip(fast, paper, strict=True)),
        "against_batches": batches,
    }
    if args.no_plain:
        print(json.dumps(report, indent=2))
        return 0
    plain, plain_figures = timed(examiner, prompts, args.budget, ExamMode.plain(args.tie_margin))

    mismatches = []
    for turn, (f, q) in enumerate(zip(fast, plain, strict=True)):
        if f.tool != q.tool:
            step = divergence(f, q)
            mismatches.append(
                {
                    "turn": turn,
                    "fast": f.tool,
                    "plain": q.tool,
                    "step": step,
                    "fast_margin": f.margins[step] if step < len(f.margins) else None,
                    "plain_margin": q.margins[step] if step < len(q.margins) else None,
                }
            )
    ties = [
        {"turn": turn, "run": run, "margin": c[0], "step": c[1]}
        for run, answers in (("fast", fast), ("plain", plain))
        for turn, a in enumerate(answers)
        if (c := a.closest()) and c[0] < args.tie_margin
    ]
    print(
        json.dumps(
            {
                **report,
                "plain_one_at_a_time": plain_figures,
                "ratio": round(plain_figures["seconds"] / fast_figures["seconds"], 2),
                "tools_named": sum(a.tool is not None for a in plain),
                "every_tool_matched": not mismatches,
                "mismatches": mismatches,
                "near_ties": ties,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
