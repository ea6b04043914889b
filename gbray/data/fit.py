"""Prompt fitting, the answer-only dataset, and collation.

Fit, don't drop: a turn that does not fit loses its oldest earlier observations first and the end
of its latest page last, so the answer always has a prompt in front of it. Truncating from the end
would cut the answer, give an all-masked turn, a NaN loss and NaN in every LoRA weight.
A user message is read as blocks separated by blank lines: the first is the job, the last is the
latest page, the ones between are earlier observations.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

IGNORE = -100
# An answer's tool: the first complete "tool": "NAME" it contains (as the exam reads it).
_ANSWER_TOOL = re.compile(r'"tool"\s*:\s*"([^"\\]+)"')


def chat_prompt_ids(tokenizer, system: str, user: str) -> list[int]:
    """Token ids of the chat prompt up to the assistant's turn, thinking switched off."""
    messages = [{"role": "user", "content": user}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    try:
        # A hybrid student must not learn to open a reasoning block before its call.
        out = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, enable_thinking=False
        )
    except TypeError:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def answer_ids(tokenizer, answer: str) -> list[int]:
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    return list(ids) + [tokenizer.eos_token_id]


def tool_tokens(tokenizer, answer: str, ids: list[int]) -> int:
    """How many of the answer's first tokens (`ids`, its tokenization) it takes to spell it up to
    the closing quote of its tool's name; 0 where it names no tool. Greedy decoding names the
    recorded tool by that path exactly when each of these tokens is the argmax under teacher
    forcing, so a validation forward pass tells what the exam would (SPEC §5)."""
    match = _ANSWER_TOOL.search(answer)
    if not match:
        return 0
    text = ""
    for k, token in enumerate(ids, start=1):
        # Decoding a growing prefix is exact for any tokenizer; answers are a few dozen tokens.
        text = tokenizer.decode(ids[:k]) if k > 1 else tokenizer.decode([token])
        if len(text) >= match.end():
            return k
    return 0


def _split_user(user: str) -> tuple[str, list[str], str]:
    blocks = [b for b in user.split("\n\n") if b.strip()]
    if len(blocks) <= 1:
        return "", [], user
    job, page = blocks[0], blocks[-1]
    observations = [line for block in blocks[1:-1] for line in block.split("\n")]
    return job, observations, page


def _join(job: str, observations: list[str], page: str) -> str:
    return "\n\n".join(part for part in (job, "\n".join(observations), page) if part)


def _longest_prefix(text: str, fits) -> str:
    """The longest prefix of text (whole lines where possible) for which fits(prefix) holds."""
    if not fits(""):  # nothing of it fits: one call, not a search (a catalogue over the window)
        return ""
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(text[:mid]):
            lo = mid
        else:
            hi = mid - 1
    cut = text[:lo]
    if lo < len(text) and "\n" in cut:
        cut = cut[: cut.rfind("\n")]
    return cut


def fit_prompt(tokenizer, system: str, user: str, budget: int) -> tuple[list[int], bool]:
    """Prompt ids of at most `budget` tokens and whether the turn had to be shortened."""
    ids = chat_prompt_ids(tokenizer, system, user)
    if len(ids) <= budget:
        return ids, False
    job, observations, page = _split_user(user)

    def size(j, obs, p, s=system):
        return len(chat_prompt_ids(tokenizer, s, _join(j, obs, p)))

    # Oldest observations first: binary search for the fewest dropped that fit.
    lo, hi = 0, len(observations)
    if size(job, [], page) > budget:  # all go, and more: one call, not a search
        lo = hi
    while lo < hi:
        mid = (lo + hi) // 2
        if size(job, observations[mid:], page) <= budget:
            hi = mid
        else:
            lo = mid + 1
    observations = observations[lo:]
    if size(job, observations, page) > budget:
        page = _longest_prefix(page, lambda p: size(job, observations, p) <= budget)
    if size(job, observations, page) > budget:
        job = _longest_prefix(job, lambda j: size(j, observations, page) <= budget)
    if size(job, observations, page) > budget:
        system = _longest_prefix(system, lambda s: size(job, observations, page, s) <= budget)
    ids = chat_prompt_ids(tokenizer, system, _join(job, observations, page))
    if len(ids) > budget:
        # Only the chat template's own tokens are left; keep its end, where the answer starts.
        ids = ids[-budget:]
    return ids, True


def window_for(
    needs: list[int], floor: int, ceiling: int, share: float = 0.9, step: int = 256
) -> int:
    """The smallest window, a multiple of `step`, that `share` of turns needing `needs` tokens
    each fit unshortened; never below `floor`, nor raised above `ceiling`. SPEC's 4096 was chosen
    the same way: it fits nine in ten sighted turns, and the rest are fitted."""
    if not needs:
        return floor
    need = sorted(needs)[max(0, math.ceil(share * len(needs)) - 1)]
    return max(floor, min(ceiling, math.ceil(need / step) * step))


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]
    tool: str
    shortened: bool
    # The answer's first tokens that spell its tool's name (`tool_tokens`); 0: not checked.
    tool_tokens: int = 0


def make_example(tokenizer, turn: dict, max_len: int, answer_room: int) -> Example:
    """One training example: the prompt masked, the answer (and its end token) labelled."""
    answer = answer_ids(tokenizer, turn["answer"])
    room = min(len(answer), answer_room)
    prompt, shortened = fit_prompt(tokenizer, turn["system"], turn["user"], max_len - room)
    answer = answer[: max_len - len(prompt)]
    return Example(
        prompt + answer,
        [IGNORE] * len(prompt) + answer,
        turn["tool"],
        shortened,
        tool_tokens(tokenizer, turn["answer"], answer),
    )


def _quiet(done: int, shortened: int) -> None:
    pass


def make_examples(
    tokenizer,
    turns: list[dict],
    max_len: int,
    answer_room: int,
    progress: Callable[[int, int], None] = _quiet,
    every: int = 500,
) -> tuple[list[Example], int]:
    """Examples of `turns` and how many were shortened; `progress(done, shortened)` is called
    after every `every` turns (fitting thousands of over-long turns takes minutes)."""
    examples, shortened = [], 0
    for done, turn in enumerate(turns, start=1):
        examples.append(make_example(tokenizer, turn, max_len, answer_room))
        shortened += examples[-1].shortened
        if done % every == 0:
            progress(done, shortened)
    return examples, shortened


def collate(examples: list[Example], pad_id: int) -> dict:
    """Right-padded tensors: input_ids, attention_mask, labels (padding labelled IGNORE)."""
    import torch

    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        ids[row, :n] = torch.tensor(e.input_ids)
        labels[row, :n] = torch.tensor(e.labels)
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
