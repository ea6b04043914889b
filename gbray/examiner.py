"""The exam (SPEC §7), a plain class: greedy answers within the answer budget, tool agreement.

It must run in a process that never trained (generate()-heavy work after backward() in one
process crashed the allocator on CPU); the round gives every exam a fresh actor.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable

import torch

from gbray.data.fit import fit_prompt
from gbray.data.turns import tool_of_answer
from gbray.model import load_student
from gbray.platform import set_threads
from gbray.results import ExamResult, ExamStopped

log = logging.getLogger(__name__)

NO_TOOL = "(no tool)"


def score(asked: list[str], answered: list[str | None]) -> dict:
    """Agreement and per-tool counts: right / asked, and what was answered instead."""
    per_tool: dict[str, dict] = defaultdict(lambda: {"asked": 0, "right": 0, "instead": Counter()})
    right = 0
    for want, got in zip(asked, answered, strict=True):
        row = per_tool[want]
        row["asked"] += 1
        if got == want:
            row["right"] += 1
            right += 1
        else:
            row["instead"][got or NO_TOOL] += 1
    n = len(asked)
    return {
        "agreement_pct": round(100.0 * right / n, 2) if n else 0.0,
        "right": right,
        "turns": n,
        "no_tool": sum(1 for a in answered if a is None),
        "per_tool": {
            tool: {
                "right": r["right"],
                "asked": r["asked"],
                "instead": dict(r["instead"].most_common()),
            }
            for tool, r in sorted(per_tool.items(), key=lambda kv: (-kv[1]["asked"], kv[0]))
        },
    }


class Examiner:
    def __init__(
        self,
        model_path: str,
        adapter: str | None,
        precision: str,
        threads: int,
        device: str,
        report: Callable[[str], None] = log.info,
        should_stop: Callable[[], bool] = lambda: False,
    ):
        self.threads = set_threads(threads)
        self.device = "cuda" if device == "cuda" else "cpu"
        self.report, self.should_stop = report, should_stop
        self.model, self.tokenizer = load_student(model_path, adapter, precision, trainable=False)
        self.model.to(self.device).eval()

    @torch.no_grad()
    def answer(self, prompts: list[list[int]], budget: int) -> list[str]:
        """Greedy answers for a batch of prompt ids (left-padded), at most `budget` new tokens."""
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device
        )
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=budget,
            do_sample=False,
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=pad,
        )
        return self.tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)

    def exam(self, turns: list[dict], answer_budget: int, max_len: int, batch: int) -> ExamResult:
        started = time.monotonic()
        last_note = started
        asked, answered, samples = [], [], []
        budget = max_len - min(answer_budget, max_len // 2)
        fitted = [fit_prompt(self.tokenizer, t["system"], t["user"], budget) for t in turns]
        # Similar lengths together: less padding, same answers.
        order = sorted(range(len(turns)), key=lambda i: len(fitted[i][0]))
        results: dict[int, str] = {}
        for i in range(0, len(order), batch):
            if self.should_stop():
                raise ExamStopped(f"stopped after {len(results)} of {len(turns)} turns")
            chunk = order[i : i + batch]
            for j, text in zip(
                chunk, self.answer([fitted[j][0] for j in chunk], answer_budget), strict=True
            ):
                results[j] = text
            now = time.monotonic()
            if now - last_note >= 30 or len(results) == len(turns):
                last_note = now
                done_right = sum(tool_of_answer(results[j]) == turns[j]["tool"] for j in results)
                self.report(
                    f"exam: {len(results)}/{len(turns)} turns, {done_right} right so far, "
                    f"{(now - started) / 60:.1f} min in"
                )
        for j in sorted(results):
            asked.append(turns[j]["tool"])
            answered.append(tool_of_answer(results[j]))
            if len(samples) < 5:
                samples.append({"asked": turns[j]["tool"], "answer": results[j][:200]})
        return ExamResult(
            **score(asked, answered),
            minutes=round((time.monotonic() - started) / 60, 2),
            pid=os.getpid(),
            shortened=sum(f[1] for f in fitted),
            samples=samples,
            threads=self.threads,
        )
