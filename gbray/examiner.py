"""The exam (SPEC §7), a plain class: greedy answers within the answer budget, tool agreement.

It must run in a process that never trained (generate()-heavy work after backward() in one
process crashed the allocator on CPU); the round gives every exam a fresh actor.

Fast without changing an answer. The prompt prefix every turn shares (the system prompt with
the tool catalogue) is computed once per exam; every row of a batch attends to that one copy
(cascade attention: the prefix part and the row's own part joined by their log-sum-exps), so a
decode step reads it once, not once per row. A turn stops generating once its answer names a
complete tool (under greedy decoding the rest of the answer cannot change the first tool named)
and leaves its batch. Batching and the cached prefix change the order of floating-point sums,
so each generated step's margin (top logit minus the runner-up) is kept: a step whose two best
tokens are within a hair may flip between the fast exam and a plain one, and such near-ties
are reported, not hidden. The reference (`ExamMode.plain()`) is generate(), a turn at a time.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import (
    AttentionInterface,
    AttentionMaskInterface,
    LogitsProcessor,
    LogitsProcessorList,
    StaticCache,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from gbray.data.fit import fit_prompt
from gbray.data.turns import tool_of_answer
from gbray.model import load_student
from gbray.platform import set_threads
from gbray.results import ExamResult, ExamStopped
from gbray.settings import ExamMode

log = logging.getLogger(__name__)

NO_TOOL = "(no tool)"
# A shared prefix shorter than this is not worth a cache.
MIN_PREFIX_TOKENS = 16
# Rows whose own parts go through the model together before the batch decodes.
PREFILL_ROWS = 16
# A batch's cache (each row's own part and answer) holds at most this: without a shared
# prefix, 64 rows of 3,000 tokens on the 0.5B shape would hold 4.6 GB.
CACHE_BYTES = 2 * 2**30
# The attention the examiner's model runs: SDPA, unless a forward is handed a shared prefix.
CASCADE = "gbray_cascade"


@dataclass
class Answer:
    """One turn's answer: its text, the tool it names, the generated ids, and at each generated
    step the margin between the chosen token's logit and the runner-up's."""

    text: str
    tool: str | None
    tokens: list[int]
    margins: list[float] = field(default_factory=list)

    def closest(self) -> tuple[float, int] | None:
        """The smallest margin and its step, over the steps that made the answer."""
        if not self.margins:
            return None
        step = min(range(len(self.margins)), key=self.margins.__getitem__)
        return self.margins[step], step


def score(asked: list[str], answered: list[str | None]) -> dict:
    """Agreement and per-tool counts: right / asked, and what was answered instead; `marks` is
    one character per turn in paper order, 1 right and 0 wrong (what pairs two exams)."""
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
        "marks": "".join(
            "1" if got == want else "0" for want, got in zip(asked, answered, strict=True)
        ),
        "per_tool": {
            tool: {
                "right": r["right"],
                "asked": r["asked"],
                "instead": dict(r["instead"].most_common()),
            }
            for tool, r in sorted(per_tool.items(), key=lambda kv: (-kv[1]["asked"], kv[0]))
        },
    }


def shared_prefix(prompts: list[list[int]]) -> list[int]:
    """The longest run of ids every prompt starts with, leaving each at least one id of its own
    (the step that predicts the answer's first token must run on the turn's own input)."""
    if not prompts:
        return []
    first = prompts[0]
    n = min(len(p) for p in prompts) - 1
    for p in prompts[1:]:
        i = 0
        while i < n and p[i] == first[i]:
            i += 1
        n = i
    return first[: max(n, 0)]


class _Margins(LogitsProcessor):
    """Keeps each step's margin (best logit minus the runner-up) per row; changes no score."""

    def __init__(self):
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids, scores):
        top = scores.float().topk(2, dim=-1).values
        self.steps.append((top[:, 0] - top[:, 1]).cpu())
        return scores

    def of_row(self, row: int, length: int) -> list[float]:
        return [float(step[row]) for step in self.steps[:length]]


@dataclass
class SharedPrefix:
    """The ids every prompt of an exam starts with and each layer's keys and values over them,
    computed once (batch of one) and read once per step by every row of a batch."""

    ids: list[int]
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)


def _attend(query, key, value, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `query` (rows, heads, queries, dim) over `key` and `value` (same rows and
    heads) where the boolean `mask` (rows, 1, queries, keys) allows it, or everywhere without
    one; with each query's log-sum-exp of scores, so that two parts of the keys can be joined
    exactly. On a CPU it is PyTorch's fused flash kernel, which returns both (6.5x the plain
    version on a 16-row prefill against a 2,443-token prefix); elsewhere the plain version."""
    if query.device.type != "cpu":
        return _attend_plain(query, key, value, mask, scale)
    bias = None
    if mask is not None:
        bias = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
        bias.masked_fill_(~mask, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, False, attn_mask=bias, scale=scale
    )
    return out, lse.float().unsqueeze(-1)


def _attend_plain(query, key, value, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(scores - lse).to(value.dtype), value), lse


def cascade_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, shared_prefix=None, **kw
):
    """Attention over a shared prefix plus each row's own keys (cascade attention).

    Every row of a batch attends to the same prefix; its keys and values are held once and read
    once per step for all rows, where a per-row copy made each decode step read the prefix
    once per row (16 rows of a 2,443-token prefix on the 0.5B shape: 1.1 GB a step). The
    prefix part and the row's own part (`key`, `value`: the batch's cache, masked by
    `attention_mask`, a boolean (batch, 1, query, columns) over its first columns) are joined
    by their log-sum-exps. Without `shared_prefix` this is SDPA, as the model would run without
    it.
    """
    if shared_prefix is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kw
        )
    rows, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    scale = scaling if scaling is not None else dim**-0.5
    # Heads kv * group .. kv * group + group - 1 read key head kv (as repeat_kv lays them out).
    grouped = query.reshape(rows, kv_heads, group * length, dim)
    # The batch's cache has room for the whole answer; only the columns the mask covers count.
    columns = attention_mask.shape[-1]
    key, value = key[:, :, :columns], value[:, :, :columns]
    mask = attention_mask[:, :, None].expand(-1, -1, group, -1, -1).reshape(rows, 1, -1, columns)
    out, lse = _attend(grouped, key, value, mask, scale)
    if len(shared_prefix):
        pk, pv = shared_prefix.keys[module.layer_idx], shared_prefix.values[module.layer_idx]
        # Every row's queries against one copy of the prefix, as one long row.
        flat = grouped.transpose(0, 1).reshape(1, kv_heads, rows * group * length, dim)
        p_out, p_lse = _attend(flat, pk, pv, None, scale)
        p_out = p_out.reshape(kv_heads, rows, -1, dim).transpose(0, 1)
        p_lse = p_lse.reshape(kv_heads, rows, -1, 1).transpose(0, 1)
        joined = torch.logaddexp(lse, p_lse)
        out = out * torch.exp(lse - joined).to(out.dtype) + p_out * torch.exp(p_lse - joined).to(
            out.dtype
        )
    out = out.reshape(rows, heads, length, dim).transpose(1, 2).contiguous()
    return out, None


AttentionInterface.register(CASCADE, cascade_attention)
# Masks as SDPA's, for the forwards without a shared prefix (generate() builds them).
AttentionMaskInterface.register(CASCADE, sdpa_mask)


def cache_argument(model) -> str:
    """What a causal LM's forward takes and returns its KV cache as: `cache` in the transformers
    releases that renamed it (5.2x), `past_key_values` before (5.17 has only that name)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


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
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        base.set_attn_implementation(CASCADE)
        self.cache_arg = cache_argument(base)
        self.stop_ids = {self.tokenizer.eos_token_id, self.tokenizer.pad_token_id} - {None}
        # What the last exam ran (read by benchmarks/exam_speed.py).
        self.prefix_tokens, self.rows = 0, 0

    # -- generation -----------------------------------------------------------------------------

    @torch.no_grad()
    def shared_prefix(self, ids: list[int]) -> SharedPrefix:
        """Each layer's keys and values over `ids`, computed once (batch of one)."""
        prefix = SharedPrefix(ids)
        if ids:
            cache = self.model(input_ids=torch.tensor([ids], device=self.device))[self.cache_arg]
            prefix.keys = [layer.keys for layer in cache.layers]
            prefix.values = [layer.values for layer in cache.layers]
        return prefix

    @torch.no_grad()
    def answer(
        self, prompts: list[list[int]], budget: int, mode: ExamMode, prefix: SharedPrefix
    ) -> list[Answer]:
        """Greedy answers for a batch of prompts that all start with `prefix`, at most `budget`
        new tokens each.

        A loop of its own rather than generate(): generate() computes every row until the
        batch's last is done and holds the shared prefix once per row. Here a finished row
        leaves the batch, and the prefix is attended to once for all rows (cascade_attention).
        Each row's own part is left-padded, so the batch's new tokens share a cache column;
        positions continue the unpadded prompt's.
        """
        head, device = len(prefix), self.device
        rests = [p[head:] for p in prompts]
        width, rows = max(len(r) for r in rests), len(prompts)
        lengths = torch.tensor([len(r) for r in rests], device=device)
        columns = torch.arange(width + budget, device=device)
        # seen[row, column]: the row attends to that column of the batch's cache.
        seen = (columns[None, :] >= width - lengths[:, None]) & (columns[None, :] < width)
        cache, logits = self._prefill(rests, prefix, width + budget)
        tokens: list[list[int]] = [[] for _ in prompts]
        margins: list[list[float]] = [[] for _ in prompts]
        live = list(range(rows))
        for step in range(budget):
            top = logits.float().topk(2, dim=-1)
            chosen = top.indices[:, 0]
            gaps = (top.values[:, 0] - top.values[:, 1]).tolist()
            keep = [
                k
                for k, (row, token) in enumerate(zip(live, chosen.tolist(), strict=True))
                if not self._done(tokens[row], margins[row], token, gaps[k], budget, mode)
            ]
            if not keep:
                break
            if len(keep) < len(live):
                index = torch.tensor(keep, device=device)
                for layer in cache.layers:
                    layer.keys, layer.values = layer.keys[index], layer.values[index]
                chosen, seen, lengths = chosen[index], seen[index], lengths[index]
                live = [live[k] for k in keep]
            seen[:, width + step] = True
            logits = self.model(
                input_ids=chosen[:, None],
                attention_mask=seen[:, None, None, : width + step + 1],
                position_ids=(head + lengths + step)[:, None],
                **{self.cache_arg: cache},
                shared_prefix=prefix,
            ).logits[:, -1]
        answers = []
        for row in range(rows):
            text = self.tokenizer.decode(tokens[row], skip_special_tokens=True)
            answers.append(Answer(text, tool_of_answer(text), tokens[row], margins[row]))
        return answers

    def _prefill(self, rests: list[list[int]], prefix: SharedPrefix, length: int):
        """Each row's own part through the model after the shared prefix, a few rows of similar
        length at a time (less padding: on the 0.5B shape 64 rows padded to the longest did 24%
        more token positions than they held); returns a cache of `length` columns for the
        whole batch with each row's part ending at the same column, and each row's logits for
        its first answer token."""
        pad, width, device = self.tokenizer.pad_token_id, max(len(r) for r in rests), self.device
        logits: list[torch.Tensor] = []
        layers: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        for at in range(0, len(rests), PREFILL_ROWS):
            part = rests[at : at + PREFILL_ROWS]
            wide = max(len(r) for r in part)
            ids = torch.tensor([[pad] * (wide - len(r)) + r for r in part], device=device)
            real = torch.tensor([len(r) for r in part], device=device)
            columns = torch.arange(wide, device=device)
            seen = columns[None, :] >= wide - real[:, None]
            causal = columns[None, :] <= columns[:, None]
            mask = (seen[:, None, :] & causal) | torch.eye(wide, dtype=torch.bool, device=device)
            chunk = StaticCache(config=self.model.config, max_cache_len=wide)
            out = self.model(
                input_ids=ids,
                attention_mask=mask[:, None],
                position_ids=(len(prefix) + columns[None, :] - (wide - real[:, None])).clamp(
                    min=len(prefix)
                ),
                **{self.cache_arg: chunk},
                shared_prefix=prefix,
                logits_to_keep=1,
            )
            logits.append(out.logits[:, -1])
            # Right-aligned in the batch's columns; the columns before are never attended to.
            layers.append(
                [
                    (torch.nn.functional.pad(c.keys, (0, 0, width - wide, 0)),
                     torch.nn.functional.pad(c.values, (0, 0, width - wide, 0)))
                    for c in chunk.layers
                ]
            )  # fmt: skip
        cache = StaticCache(config=self.model.config, max_cache_len=length)
        for i, layer in enumerate(cache.layers):
            layer.update(
                torch.cat([part[i][0] for part in layers]),
                torch.cat([part[i][1] for part in layers]),
            )
        return cache, torch.cat(logits)

    def _done(self, answer, margins, token, margin, budget, mode: ExamMode) -> bool:
        """Takes a row's next greedy token; whether its answer is then done (a stop token, its
        budget spent, or, when the mode stops there, a complete tool named)."""
        margins.append(margin)
        if token in self.stop_ids:
            return True
        answer.append(token)
        return len(answer) >= budget or (mode.stop_at_tool and self._names_tool(answer))

    def _names_tool(self, tokens: list[int]) -> bool:
        """Whether an answer so far names a complete tool; only a token holding a quote can
        complete one, so only then is the whole answer decoded."""
        if '"' not in self.tokenizer.decode(tokens[-1:]):
            return False
        return tool_of_answer(self.tokenizer.decode(tokens, skip_special_tokens=True)) is not None

    @torch.no_grad()
    def plain_answer(self, prompt: list[int], budget: int) -> Answer:
        """The reference: generate() over the whole prompt, to EOS or the whole budget."""
        margins = _Margins()
        out = self.model.generate(
            input_ids=torch.tensor([prompt], device=self.device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=self.device),
            max_new_tokens=budget,
            do_sample=False,
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
            logits_processor=LogitsProcessorList([margins]),
        )
        generated = out[0, len(prompt) :].tolist()
        length = next(
            (i + 1 for i, t in enumerate(generated) if t in self.stop_ids), len(generated)
        )
        tokens = [t for t in generated[:length] if t not in self.stop_ids]
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return Answer(text, tool_of_answer(text), tokens, margins.of_row(0, length))

    def answers(
        self, prompts: list[list[int]], budget: int, mode: ExamMode, asked: list[str] | None = None
    ) -> list[Answer]:
        """Every prompt's answer, in order: the shared prefix computed once, then batches of
        similar lengths (the reference mode: generate(), a turn at a time). Progress lines
        count right answers when `asked` (the tool each turn asks for) is given."""
        head = [] if mode.reference else shared_prefix(prompts)
        prefix = self.shared_prefix(head if len(head) >= MIN_PREFIX_TOKENS else [])
        self.prefix_tokens = len(prefix)
        # Similar lengths together: less padding, same answers.
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: dict[int, Answer] = {}
        started = last_note = time.monotonic()
        rows = 1 if mode.reference else self._rows(prompts, prefix, budget, mode.batch)
        self.rows = rows
        for i in range(0, len(order), rows):
            if self.should_stop():
                raise ExamStopped(f"stopped after {len(results)} of {len(prompts)} turns")
            chunk = order[i : i + rows]
            if mode.reference:
                answered = [self.plain_answer(prompts[j], budget) for j in chunk]
            else:
                answered = self.answer([prompts[j] for j in chunk], budget, mode, prefix)
            results.update(zip(chunk, answered, strict=True))
            now = time.monotonic()
            if now - last_note >= 30 or len(results) == len(prompts):
                last_note = now
                right = sum(asked[j] == a.tool for j, a in results.items()) if asked else None
                self.report(
                    f"exam: {len(results)}/{len(prompts)} turns"
                    + (f", {right} right so far" if right is not None else "")
                    + f", {(now - started) / 60:.1f} min in"
                )
        return [results[j] for j in range(len(prompts))]

    def _rows(self, prompts, prefix: SharedPrefix, budget: int, most: int) -> int:
        """Turns to a batch: `most`, or fewer where their cache would pass CACHE_BYTES."""
        config = self.model.config
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        size = next(self.model.parameters()).element_size()
        columns = max(len(p) for p in prompts) - len(prefix) + budget
        per_row = columns * config.num_hidden_layers * 2 * kv_heads * dim * size
        return max(1, min(most, CACHE_BYTES // per_row))

    # -- the exam -------------------------------------------------------------------------------

    def exam(
        self, turns: list[dict], answer_budget: int, max_len: int, mode: ExamMode
    ) -> ExamResult:
        started = time.monotonic()
        budget = max_len - min(answer_budget, max_len // 2)
        fitted = [fit_prompt(self.tokenizer, t["system"], t["user"], budget) for t in turns]
        asked = [t["tool"] for t in turns]
        answers = self.answers([f[0] for f in fitted], answer_budget, mode, asked)
        scored = score(asked, [a.tool for a in answers])
        return ExamResult(
            **scored,
            minutes=round((time.monotonic() - started) / 60, 2),
            pid=os.getpid(),
            shortened=sum(f[1] for f in fitted),
            samples=[
                {"asked": t, "answer": a.text[:200]} for t, a in zip(asked, answers, strict=True)
            ][:5],
            threads=self.threads,
            near_ties=near_ties(answers, mode.tie_margin),
            generated_tokens=sum(len(a.tokens) for a in answers),
            prefix_tokens=self.prefix_tokens,
            stop_at_tool=mode.stop_at_tool,
        )


def near_ties(answers: list[Answer], margin: float) -> list[dict]:
    """Turns whose answer passed through a step with two best tokens closer than `margin`: the
    turns where a different order of sums could have named another tool."""
    ties = []
    for turn, answer in enumerate(answers):
        closest = answer.closest()
        if closest and closest[0] < margin:
            ties.append({"turn": turn, "margin": closest[0], "step": closest[1]})
    return ties
