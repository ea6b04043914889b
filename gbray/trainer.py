"""The training loop (SPEC §5), a plain class: it knows nothing of Ray or HTTP.

It is handed `report(line)` for progress lines, `on_check(point)` for validation points and
`should_stop()` to poll; the round decides where those go.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gbray.data.fit import Example, collate, make_examples
from gbray.model import answer_loss, load_student, validation_rows
from gbray.platform import set_threads
from gbray.prefix import (
    common_prefix,
    prefix_to_share,
    shared_prefix_step,
    shared_prefix_sums,
    use_prefix_attention,
)
from gbray.results import TrainSummary
from gbray.schedule import Schedule
from gbray.settings import Recipe
from gbray.tuning import Choices, SavedForBackward, autocast, choose, native_bfloat16
from gbray.validation import Check, keeps, most_right

log = logging.getLogger(__name__)

REPLAN_AFTER_STEPS = 5


def _nothing(*_args) -> None:
    return None


class NoSync:
    """A trainer alone: nothing to sync with. Shares that train together get a link to the
    night's averager (`gbray.averaging.Averager`, through its actor)."""

    pools = False  # whether each step's gradients are pooled with the other shares'

    def join(self, weights: dict) -> dict:
        return weights

    def due(self, turns_since: int) -> bool:
        return False

    def exchange(self, weights: dict, turns: int) -> dict:
        return weights

    def pool(self, grads: dict, turns: int) -> tuple[dict, int]:
        return grads, turns

    def leave(self, weights: dict | None, turns: int) -> None:
        return None


def planned_steps(turns: int, recipe: Recipe) -> int:
    micro = math.ceil(turns * recipe.epochs / recipe.batch)
    return max(1, math.ceil(micro / recipe.accum))


def _memory_gb(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 1e9
    import psutil

    return psutil.Process().memory_info().rss / 1e9


@dataclass
class Timing:
    """The night's clock, in this process's clock: when the budget began (earlier than this
    process after a crash; the same moment for every share of a night) and ends, and what
    training has measured of its own speed."""

    night_start: float
    deadline: float
    data_total: int
    started: float = 0.0  # when this process began training
    speed_from: float = 0.0
    speed_step: int = 1  # the step speed is measured from
    last_val: float = 0.0
    last_save: float = 0.0
    val_seconds: float | None = None  # how long the last validation took
    val_turns: int = 0

    def __post_init__(self):
        self.speed_from = self.last_val = self.last_save = self.started

    def final_validation_reserve(self, now: float, turn_passes: int) -> float:
        """Seconds kept back for the validation that ends training, so the round ends inside its
        hours: the last validation's time, else a forward pass per held-out turn estimated at a
        third of a training pass."""
        if self.val_seconds is not None:
            return self.val_seconds
        per_pass = (now - self.started) / max(1, turn_passes)
        return per_pass * self.val_turns / 3

    def training_end(self, now: float, turn_passes: int) -> float:
        """When training must stop for the final validation to end inside the hours."""
        return self.deadline - self.final_validation_reserve(now, turn_passes)

    def night(self, now: float, turn_passes: int) -> tuple[float, float, float]:
        """(seconds into the night, seconds its training lasts, seconds its budget lasts): what
        the schedule is told."""
        end = self.training_end(now, turn_passes) - self.night_start
        return now - self.night_start, end, self.deadline - self.night_start


@dataclass
class TrainState:
    steps: int = 0
    micro: int = 0
    turn_passes: int = 0
    pending: int = 0  # micro-batches back-propagated since the last optimizer step
    pending_turns: int = 0
    skipped_nan: int = 0
    losses: list = field(default_factory=list)
    seen: set = field(default_factory=set)
    checks: list[Check] = field(default_factory=list)
    kept: int | None = None  # which check's adapter is kept (OUT/best)
    checks_without_gain: int = 0
    why: str = "finished"
    shared_steps: int = 0  # optimizer steps whose turns ran their shared prefix once
    shared_pending: bool = False  # the step in progress did
    tokens: int = 0  # tokens of the turns trained
    spared: int = 0  # of those, prefix tokens not run again

    @property
    def kept_check(self) -> Check | None:
        return self.checks[self.kept] if self.kept is not None else None

    @classmethod
    def restored(cls, saved: dict) -> TrainState:
        return cls(
            **{
                **saved,
                "seen": set(saved["seen"]),
                "checks": [Check(**c) for c in saved["checks"]],
            }
        )


RESUME_FILE = "resume.pt"


class Trainer:
    def __init__(
        self,
        model_path: str,
        adapter: str | None,
        recipe: Recipe,
        out: Path,
        report: Callable[[str], None] = log.info,
        on_check: Callable[[dict], None] = _nothing,
        should_stop: Callable[[], bool] = lambda: False,
        on_saved: Callable[[str, Path], None] = _nothing,
        clock: Callable[[], float] = time.monotonic,
        start_name: str | None = None,
        pause_per_turn: float = 0.0,
        run_id: str | None = None,
        native_bf16: Callable[[], tuple[bool, str]] = native_bfloat16,
        sync=None,
    ):
        self.recipe, self.out = recipe, Path(out)
        self.sync = sync or NoSync()
        self.averaged = 0
        self.sync_seconds = 0.0  # spent handing movements to the averager and taking the global
        self.synced_at = 0  # turn-passes at the last sync with the other shares
        self.pooled_turns = 0  # other shares' turns taken in by pooled gradients
        self.on_saved = on_saved
        self.start = start_name
        self.resumed: dict | None = None
        # Seconds idled after every turn-pass: a slower machine, simulated (tests of shares).
        self.pause_per_turn = pause_per_turn
        # Only a checkpoint of this same run is carried on from (a restarted actor keeps it).
        self.run_id = run_id
        self.report, self.on_check, self.should_stop, self.clock = (
            report,
            on_check,
            should_stop,
            clock,
        )
        self.threads = set_threads(recipe.threads)
        torch.manual_seed(recipe.seed or 0)
        self.device = "cuda" if recipe.device == "cuda" else "cpu"
        self.model, self.tokenizer = load_student(
            model_path, adapter, recipe.weights_precision, trainable=True, lora=recipe.lora
        )
        self.model.to(self.device)
        self.prefix_attention = self.device == "cpu" and use_prefix_attention(self.model)
        # Where the machine decides (autocast, checkpointing), the first probe or training
        # measures it: see `configure`.
        self.native_bf16 = native_bf16
        self.choices: Choices | None = None
        self.model.config.use_cache = False
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(params, recipe)

    # -- configuration ------------------------------------------------------------------------

    def configure(self, longest: int) -> Choices:
        """Settle autocast and checkpointing on this machine (once): `longest` is the longest
        micro-batch in tokens. Printed, and returned with the training summary."""
        if self.choices is None:
            self.choices = choose(
                self.recipe,
                self.threads,
                self.device,
                self._probe_step,
                longest,
                self.native_bf16,
                self.prefix_attention,
            )
            self.threads = self.choices.threads
            if self.choices.checkpointing:
                self._checkpoint_activations()
            self.report(self.choices.line())
        return self.choices

    def _checkpoint_activations(self) -> None:
        kwargs = {"use_reentrant": False}
        if hasattr(self.model, "activation_checkpointing_enable"):
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:  # transformers before 5
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        # The frozen base must still build a graph back to the adapters.
        self.model.enable_input_require_grads()

    def _probe_step(self, tokens: int, autocast_on: bool, _checkpointing: bool) -> int:
        """One forward and backward on `tokens` ids (answer labelled on the last eight), its
        gradients thrown away; returns the bytes the forward saved for backward. The random
        state is put back after, so probing does not change what training draws (dropout)."""
        with torch.random.fork_rng(devices=[]):
            return self._probe_once(tokens, autocast_on)

    def _probe_once(self, tokens: int, autocast_on: bool) -> int:
        self.model.train()
        generator = torch.Generator().manual_seed(0)
        vocab = self.model.get_input_embeddings().num_embeddings
        ids = torch.randint(0, vocab, (1, tokens), generator=generator).to(self.device)
        labels = torch.full_like(ids, -100)
        labels[:, -8:] = ids[:, -8:]
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
        with SavedForBackward(self.model) as saved, autocast(self.device, autocast_on):
            loss, _ = answer_loss(self.model, batch)
        loss.backward()
        self.optimizer.zero_grad(set_to_none=True)
        return saved.bytes

    # -- pieces -------------------------------------------------------------------------------

    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device) for k, v in batch.items()}

    def micro_step(self, examples: list[Example], state: TrainState) -> float | None:
        """Forward and backward one micro-batch; a non-finite loss is skipped and counted."""
        self.model.train()
        batch = self._to_device(collate(examples, self.tokenizer.pad_token_id))
        choices = self.configure(batch["input_ids"].numel())
        with autocast(self.device, choices.autocast):
            loss, _ = answer_loss(self.model, batch)
        state.micro += 1
        if not torch.isfinite(loss):
            state.skipped_nan += 1
            self.report(f"skipped a non-finite loss ({state.skipped_nan} so far)")
            return None
        (loss / self.recipe.accum).backward()
        if self.pause_per_turn:
            time.sleep(self.pause_per_turn * len(examples))
        state.pending += 1
        value = loss.item()
        state.losses.append(value)
        return value

    def accumulate(self, micro_batches: list[list[Example]], state: TrainState) -> None:
        """Forward and backward of one optimizer step's micro-batches (or what is left of it):
        their shared prompt prefix run once where that is on and spares enough, else one
        micro-batch at a time. The gradients are the same either way."""
        turns = [e for batch in micro_batches for e in batch]
        state.tokens += sum(len(e.input_ids) for e in turns)
        choices = self.configure(max(len(e.input_ids) for e in turns))
        prefix = prefix_to_share(micro_batches) if choices.share_prefix else 0
        if not prefix:
            for batch in micro_batches:
                self.micro_step(batch, state)
            return
        self.model.train()
        step = shared_prefix_step(
            self.model,
            micro_batches,
            prefix,
            self.recipe.accum,
            self.tokenizer.pad_token_id,
            self.device,
            lambda: autocast(self.device, choices.autocast),
        )
        state.shared_pending = True
        state.spared += (len(turns) - 1) * prefix
        for value in step.losses:
            state.micro += 1
            if value is None:
                state.skipped_nan += 1
                self.report(f"skipped a non-finite loss ({state.skipped_nan} so far)")
                continue
            state.pending += 1
            state.losses.append(value)
        if self.pause_per_turn:
            time.sleep(self.pause_per_turn * len(turns))

    def optimizer_step(self, state: TrainState, rate: float) -> None:
        """One optimizer step at `rate` with what was accumulated (none: nothing moves)."""
        if state.pending and state.pending_turns and self.sync.pools:
            rate *= self.pool_gradients(state.pending_turns)
        for group in self.optimizer.param_groups:
            group["lr"] = rate
        if state.pending:
            torch.nn.utils.clip_grad_norm_(
                [p for p in self.model.parameters() if p.requires_grad], self.recipe.grad_clip
            )
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        state.pending = 0
        state.pending_turns = 0
        state.shared_steps += state.shared_pending
        state.shared_pending = False
        state.steps += 1

    def pool_gradients(self, turns: int) -> float:
        """This step's gradients pooled with the other shares' newest (gbray.averaging); returns
        the factor on the rate, sqrt(turns pooled / a whole step's), at least 1. A whole step's,
        not this one's: members stepping together whose steps differ (one ends its part of the
        slice mid-step) step at one rate on one gradient, and so keep one adapter."""
        began = self.clock()
        params = {
            n: p for n, p in self.model.named_parameters() if p.requires_grad and p.grad is not None
        }
        # A copy: an averager in this process keeps what it is handed, and p.grad is overwritten.
        mine = {n: p.grad.detach().to("cpu", copy=True) for n, p in params.items()}
        pooled, total = self.sync.pool(mine, turns)
        for n, p in params.items():
            p.grad.copy_(pooled[n])
        self.sync_seconds += self.clock() - began
        self.pooled_turns += total - turns
        return max(1.0, math.sqrt(total / (self.recipe.batch * self.recipe.accum)))

    def adapter_weights(self) -> dict:
        from peft import get_peft_model_state_dict

        return {k: v.detach().cpu() for k, v in get_peft_model_state_dict(self.model).items()}

    def set_adapter_weights(self, weights: dict) -> None:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(self.model, weights)

    def sync_with_other_shares(self, state: TrainState) -> None:
        """Hands what this share moved since its last sync to the night's averager and carries
        on from the global it gets back (`gbray.averaging`). Optimizer moments stay local."""
        turns = state.turn_passes - self.synced_at
        began = self.clock()
        mine = self.adapter_weights()
        handed = self.sync.exchange(mine, turns)
        if handed is not mine:  # a share stepping together in a group keeps its own
            self.set_adapter_weights(handed)
        self.sync_seconds += self.clock() - began
        self.synced_at = state.turn_passes
        self.averaged += 1
        if self.averaged in (1, 10) or self.averaged % 100 == 0:  # a line now and then
            self.report(f"synced with the other shares ({self.averaged} syncs so far)")

    @contextlib.contextmanager
    def kept_weights(self):
        """The weights a validation measures and an adapter file holds. Schedule-Free AdamW
        keeps them apart from those it trains (its running average); other optimizers train
        the weights they keep."""
        switch = getattr(self.optimizer, "eval", None)
        if switch is None:
            yield
            return
        switch()
        try:
            yield
        finally:
            self.optimizer.train()

    def validation_scores(self, examples: list[Example]) -> tuple[float, str]:
        """Teacher-forced loss on held-out turns (weighted by labelled tokens; NaN if none is
        finite) and, per turn, whether greedy decoding would name its recorded tool ("1"/"0"):
        one forward pass each, the prompt prefix they share run once where that is on."""
        if not examples:
            return math.nan, ""
        # Configured (its probes run backward) before the forward passes, which keep no graph.
        choices = self.configure(max(len(e.input_ids) for e in examples))
        self.model.eval()
        prefix = prefix_to_share([examples]) if choices.share_prefix else 0
        with torch.no_grad(), self.kept_weights():
            if prefix:
                sums, counts, named = shared_prefix_sums(
                    self.model,
                    examples,
                    prefix,
                    self.tokenizer.pad_token_id,
                    self.device,
                    lambda: autocast(self.device, choices.autocast),
                )
            else:
                sums, counts, named = [], [], []
                size = max(1, self.recipe.batch)
                for i in range(0, len(examples), size):
                    part = examples[i : i + size]
                    batch = self._to_device(collate(part, self.tokenizer.pad_token_id))
                    wanted = torch.tensor([e.tool_tokens for e in part], device=self.device)
                    with autocast(self.device, choices.autocast):
                        s, n, right = validation_rows(self.model, batch, wanted)
                    sums += s.tolist()
                    counts += n.tolist()
                    named += right.tolist()
        finite = [(s, n) for s, n in zip(sums, counts, strict=True) if n and math.isfinite(s)]
        count = sum(n for _, n in finite)
        loss = sum(s for s, _ in finite) / count if count else math.nan
        return loss, "".join("1" if r else "0" for r in named)

    def validation_loss(self, examples: list[Example]) -> float:
        return self.validation_scores(examples)[0]

    def save(
        self, name: str, state: TrainState, schedule: Schedule | None = None, elapsed: float = 0.0
    ) -> Path:
        """The adapter in its own folder with trainer_state.json. With `schedule`, also
        everything training needs to carry on from here after a crash: the optimizer, the
        schedule, the counters and the random state (resume.pt)."""
        with self.kept_weights():  # the optimizer's state is saved in the same mode
            return self._save(name, state, schedule, elapsed)

    def _save(self, name: str, state: TrainState, schedule: Schedule | None,
              elapsed: float) -> Path:  # fmt: skip
        path = self.out / name
        self.model.save_pretrained(path)
        kept = state.kept_check
        record = {
            "step": state.steps,
            "turn_passes": state.turn_passes,
            "best_val_loss": kept.loss if kept else None,
            "best_val_agreement": kept.agreement if kept else None,
            "start": self.start,
        }
        (path / "trainer_state.json").write_text(json.dumps(record))
        if schedule is not None:
            torch.save(
                {
                    "optimizer": self.optimizer.state_dict(),
                    "schedule": dataclasses.asdict(schedule),
                    "state": {**dataclasses.asdict(state), "seen": sorted(state.seen)},
                    "elapsed": elapsed,
                    "rng": torch.get_rng_state(),
                    "run": self.run_id,
                },
                path / (RESUME_FILE + ".tmp"),
            )
            (path / (RESUME_FILE + ".tmp")).replace(path / RESUME_FILE)
        return path

    def resume(self, examples: int) -> tuple[TrainState, Schedule, float] | None:
        """The state saved in OUT/last, if it is a checkpoint of this same run: loads the adapter's
        weights and the optimizer's state. Returns (state, schedule, elapsed seconds), or None."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        path = self.out / "last" / RESUME_FILE
        if not path.is_file():
            return None
        saved = torch.load(path, weights_only=False)
        if self.run_id is None or saved.get("run") != self.run_id or "schedule" not in saved:
            return None
        if saved["state"]["turn_passes"] > math.ceil(examples * self.recipe.epochs):
            return None
        set_peft_model_state_dict(
            self.model, load_file(str(self.out / "last" / "adapter_model.safetensors"))
        )
        self.optimizer.load_state_dict(saved["optimizer"])
        if hasattr(self.optimizer, "train"):  # saved with the weights it keeps; back to training
            self.optimizer.train()
        torch.set_rng_state(saved["rng"])
        state = TrainState.restored(saved["state"])
        self.resumed = {"step": state.steps, "optimizer": optimizer_digest(self.optimizer)}
        return state, Schedule(**saved["schedule"]), float(saved["elapsed"])

    def validate(self, val: list[Example], state: TrainState, schedule: Schedule,
                 minute: float) -> Check:  # fmt: skip
        """Loss and agreement on the validation turns; the adapter is kept (OUT/best) where
        this check beats the one kept so far (`gbray.validation.keeps`)."""
        began = self.clock()
        loss, marks = self.validation_scores(val)
        took = self.clock() - began
        recent = state.losses[-50:]
        check = Check(
            step=state.steps,
            turns=state.turn_passes,
            loss=loss if math.isfinite(loss) else None,
            agreement=round(100 * marks.count("1") / len(marks), 2) if marks else None,
            marks=marks,
            lr=self.optimizer.param_groups[0]["lr"],
            phase=schedule.phase(state.steps),
            minute=round(minute, 2),
            train_loss=sum(recent) / len(recent) if recent else None,
        )
        top = most_right(state.checks)
        check.kept = keeps(check, state.kept_check, top, self.recipe.min_gain, self.recipe.keep_by)
        state.checks.append(check)
        if check.kept:
            state.kept, state.checks_without_gain = len(state.checks) - 1, 0
            self.save("best", state)
        else:
            state.checks_without_gain += 1
        self.on_check(check.wire())
        agreement = "n/a" if check.agreement is None else f"{check.agreement:.1f}%"
        self.report(
            f"validation at step {state.steps} ({check.phase}, lr {check.lr:.1e}): loss "
            f"{loss:.4f}, agreement {agreement}"
            + (" (kept)" if check.kept else f" ({state.checks_without_gain} without gain)")
            + f", {len(val)} turns in {took:.1f} s"
        )
        return check

    def progress_line(
        self,
        state: TrainState,
        schedule: Schedule,
        passes_total: int,
        epoch: int,
        timing: Timing,
    ) -> str:
        now = self.clock()
        minutes_in = (now - timing.night_start) / 60
        per_step = (now - timing.night_start) / state.steps if state.steps else None
        left_by_plan = (schedule.total - state.steps) * per_step / 60 if per_step else None
        left = (
            (timing.deadline - now) / 60
            if left_by_plan is None
            else min(left_by_plan, (timing.deadline - now) / 60)
        )
        recent = state.losses[-16:]
        loss = f"{sum(recent) / len(recent):.3f}" if recent else "n/a"
        return (
            f"{state.turn_passes}/{passes_total} turn-passes · epoch {epoch}/{math.ceil(self.recipe.epochs)}"
            f" · step {state.steps}/{schedule.total} ({state.pending_turns}/{self.recipe.accum * self.recipe.batch}"
            f" turns into the next) · loss {loss} · lr {self.optimizer.param_groups[0]['lr']:.1e}"
            f" ({schedule.phase(state.steps)})"
            f" · {minutes_in:.0f} min in, about {max(0.0, left):.0f} min left, {_memory_gb(self.device):.1f} GB"
        )

    def _maybe_validate(self, val: list[Example], state: TrainState, timing: Timing,
                        schedule: Schedule) -> bool:  # fmt: skip
        recipe = self.recipe
        due_by_time = (
            recipe.val_every_minutes
            and self.clock() - timing.last_val >= recipe.val_every_minutes * 60
        )
        due_by_steps = recipe.val_every_steps and state.steps % recipe.val_every_steps == 0
        if not (due_by_time or due_by_steps):
            return False
        began = self.clock()
        self.validate(val, state, schedule, (began - timing.night_start) / 60)
        timing.last_val = self.clock()
        timing.val_seconds = timing.last_val - began
        spent = 1 - (timing.deadline - self.clock()) / (recipe.hours * 3600)
        if state.checks_without_gain >= recipe.patience and spent >= recipe.patience_after:
            self._plateau(state, timing, schedule)
        return True

    def _plateau(self, state: TrainState, timing: Timing, schedule: Schedule) -> None:
        """Validation stopped improving: the cool-down starts from where the rate stands (wsd;
        the night ends when it is done), or the night ends here (cosine, as nights did, and
        schedule-free, which has no cool-down)."""
        if schedule.kind != "wsd":
            state.why = "patience"
            return
        if schedule.cool_step is not None or state.steps < schedule.warmup:
            return  # cooling down already, or still warming up: no plateau to speak of
        elapsed, end, _ = timing.night(self.clock(), state.turn_passes)
        schedule.begin_cool_down(state.steps, elapsed, end, "plateau")
        self.report(
            f"plateau: {state.checks_without_gain} checks without gain; cooling down from "
            f"lr {schedule.cool_from:.1e} at step {state.steps}, for about "
            f"{(schedule.cool_until - schedule.cool_at) / 60:.1f} min, then the night ends"
        )

    def _replan(self, schedule: Schedule, state: TrainState, timing: Timing) -> None:
        now = self.clock()
        per_step = (now - timing.speed_from) / max(1, state.steps - timing.speed_step)
        was = schedule.total
        # Training stops where the final validation's time begins, not at the deadline.
        left = timing.training_end(now, state.turn_passes) - now
        if schedule.replan(state.steps, per_step, left):
            self.report(
                f"re-planned: {schedule.total} steps fit the time left (was {was}), "
                f"warm-up {schedule.warmup}"
            )

    def _maybe_cool_down(self, schedule: Schedule, state: TrainState, timing: Timing) -> None:
        elapsed, end, night = timing.night(self.clock(), state.turn_passes)
        why = schedule.cool_down_due(state.steps, elapsed, night)
        if why is None:
            return
        schedule.begin_cool_down(state.steps, elapsed, end, why)
        what = {
            "time": f"the last {schedule.cooldown:.0%} of the night's time",
            "data": f"the last {schedule.cooldown:.0%} of the slice's steps",
        }[why]
        self.report(
            f"cool-down from step {state.steps}: lr {schedule.cool_from:.1e} to "
            f"{schedule.floor:.1e} over {what}"
        )

    # -- the loop -----------------------------------------------------------------------------

    def probe(self, turns: list[dict]) -> float:
        """Turn-passes an hour this machine does on these turns (forward and backward after one
        warm-up, no optimizer step): what shares are sized by."""
        examples, _ = make_examples(
            self.tokenizer, turns, self.recipe.max_len, self.recipe.answer_room
        )
        if not examples:
            return 0.0
        size = max(1, self.recipe.batch)
        batches = [examples[i : i + size] for i in range(0, len(examples), size)]
        self.configure(longest_batch(examples, size))
        state = TrainState()
        self.micro_step(batches[0], state)
        started = self.clock()
        for batch in batches[1:] or batches:
            self.micro_step(batch, state)
        seconds = self.clock() - started
        self.optimizer.zero_grad(set_to_none=True)
        passes = sum(len(b) for b in (batches[1:] or batches))
        speed = passes * 3600 / max(seconds, 1e-6)
        self.report(f"speed probe: {speed:.0f} turn-passes an hour on {self.threads} threads")
        return speed

    def step_speed(self, turns: list[dict], per_step: int) -> float:
        """Turn-passes an hour in whole steps as a round runs them: `per_step` turns a step, their
        shared prompt prefix run once where that is on, the optimizer stepped; after one
        warm-up step. What a student's short-round recipe is chosen from (gbray.short_round)."""
        examples, _ = make_examples(
            self.tokenizer, turns, self.recipe.max_len, self.recipe.answer_room
        )
        steps = [examples[i : i + per_step] for i in range(0, len(examples), per_step)]
        if not steps:
            return 0.0
        state = TrainState()
        timed = steps[1:] or steps
        for i, step in enumerate([steps[0], *timed]):
            if i == 1:
                started = self.clock()
            self.accumulate([[e] for e in step], state)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        seconds = self.clock() - started
        speed = sum(len(s) for s in timed) * 3600 / max(seconds, 1e-6)
        self.report(f"step speed: {speed:.0f} turn-passes an hour, {per_step} turns a step")
        return speed

    def _order(self, n: int, epoch: int) -> list[int]:
        """The shuffled order of one epoch: seeded by the draw seed and the epoch, so a run that
        carries on after a crash goes through the same order from where it was."""
        order = list(range(n))
        random.Random(f"{self.recipe.seed}:{epoch}").shuffle(order)
        return order

    def slice_examples(self, turns: list[dict]) -> tuple[list[Example], int]:
        """The slice's examples, with a line every 30 s while they take long: a slice of
        thousands of turns over the window takes minutes to fit."""
        began = last = self.clock()

        def progress(done: int, shortened: int) -> None:
            nonlocal last
            if self.clock() - last >= 30:
                last = self.clock()
                self.report(
                    f"preparing the slice: {done}/{len(turns)} turns, {shortened} shortened to "
                    f"fit {self.recipe.max_len} tokens, {last - began:.0f} s in"
                )

        return make_examples(
            self.tokenizer, turns, self.recipe.max_len, self.recipe.answer_room, progress
        )

    def train(
        self, train_turns: list[dict], val_turns: list[dict], ends_at: float | None = None
    ) -> TrainSummary:
        """Train within the hours; `ends_at` (wall-clock seconds), where given, is when the
        night's budget ends for every share of it, so they keep one clock."""
        recipe = self.recipe
        # The hours begin here: fitting a slice of long turns to the window takes minutes, and
        # "train until morning" counts them as the shares' common clock (`ends_at`) does.
        entered = self.clock()
        examples, shortened = self.slice_examples(train_turns)
        val, _ = make_examples(self.tokenizer, val_turns, recipe.max_len, recipe.answer_room)
        if not examples:
            raise ValueError("no turns to train on")
        preparing = self.clock() - entered
        self.configure(longest_batch(examples, recipe.batch))
        passes_total = math.ceil(len(examples) * recipe.epochs)
        data_total = planned_steps(len(examples), recipe)
        schedule = Schedule.new(
            recipe.schedule, recipe.lr, recipe.min_lr_ratio, recipe.warmup, data_total,
            recipe.cooldown,
        )  # fmt: skip
        state, elapsed = TrainState(), 0.0
        carried = self.resume(len(examples))
        if carried is not None:
            state, schedule, elapsed = carried
            self.report(
                f"resumed from the last checkpoint at step {state.steps} "
                f"({state.turn_passes} turn-passes, {elapsed / 60:.1f} min already spent)"
            )
        # The budget counts what was spent before a crash, and the configuration's probes.
        deadline = entered - elapsed + recipe.hours * 3600
        if ends_at is not None:  # the night's clock (process clocks differ; wall clocks agree)
            deadline = self.clock() + (ends_at - time.time())
        self.report(
            f"training {len(examples)} turns ({shortened} shortened to fit {recipe.max_len} tokens, "
            f"prepared in {preparing:.0f} s of the budget), "
            f"{recipe.epochs:g} epochs, {schedule.total} steps planned, {recipe.hours * 60:.1f} min budget, "
            f"{self.threads} threads on {self.device}; schedule {schedule.kind}, validation on "
            f"{len(val)} turns"
        )
        shared = common_prefix(examples) if self.choices.share_prefix and len(examples) > 1 else 0
        if shared:
            mean = sum(len(e.input_ids) for e in examples) / len(examples)
            self.report(
                f"the slice's turns all begin with the same {shared} tokens ({shared / mean:.0%} "
                "of a turn): each step runs what its turns share once"
            )
        timing = Timing(
            night_start=deadline - recipe.hours * 3600,
            deadline=deadline,
            data_total=data_total,
            started=self.clock(),
            val_turns=len(val),
        )
        # Shares start from the night's global adapter (a share that joins late, from what the
        # others have learned so far).
        self.set_adapter_weights(self.sync.join(self.adapter_weights()))
        self.synced_at = state.turn_passes
        speed_passes = -1  # measured from the end of the first step this process takes
        last_note = self.clock()
        first_note_done = False
        n = len(examples)
        epoch = state.turn_passes // n

        def rate() -> float:
            elapsed, end, _ = timing.night(self.clock(), state.turn_passes)
            return schedule.rate(state.steps, elapsed, end)

        while state.turn_passes < passes_total and state.why == "finished":
            epoch, offset = divmod(state.turn_passes, n)
            order = self._order(n, epoch)
            i = offset
            while i < n:
                # What completes the optimizer step in progress, in micro-batches of `batch`.
                room = (recipe.accum - state.micro % recipe.accum) * recipe.batch
                chunk = order[i : i + room][: passes_total - state.turn_passes]
                if not chunk:
                    break
                i += len(chunk)
                self.accumulate(
                    [
                        [examples[j] for j in chunk[k : k + recipe.batch]]
                        for k in range(0, len(chunk), recipe.batch)
                    ],
                    state,
                )
                state.turn_passes += len(chunk)
                state.pending_turns += len(chunk)
                state.seen.update(chunk)
                if state.micro % recipe.accum == 0:
                    self.optimizer_step(state, rate())
                    if self.sync.due(state.turn_passes - self.synced_at):
                        self.sync_with_other_shares(state)
                    if speed_passes == -1:
                        # The first step carries start-up costs; speed is measured from its end.
                        timing.speed_from, speed_passes = self.clock(), state.turn_passes
                        timing.speed_step = state.steps
                    self._maybe_cool_down(schedule, state, timing)
                    validated = self._maybe_validate(val, state, timing, schedule)
                    if validated:  # the night's mark may have passed while it validated
                        self._maybe_cool_down(schedule, state, timing)
                    if state.steps == REPLAN_AFTER_STEPS or (
                        validated and state.steps > REPLAN_AFTER_STEPS
                    ):
                        self._replan(schedule, state, timing)
                    if schedule.cool_why == "plateau":
                        elapsed, end, _ = timing.night(self.clock(), state.turn_passes)
                        if schedule.cooled(state.steps, elapsed, end) >= 1:
                            state.why = "plateau"
                    if self.clock() - timing.last_save >= recipe.last_every_minutes * 60:
                        spent = self.clock() - timing.night_start
                        self.on_saved("last", self.save("last", state, schedule, spent))
                        timing.last_save = self.clock()
                now = self.clock()
                if (
                    not first_note_done and state.turn_passes >= min(4, passes_total)
                ) or now - last_note >= recipe.progress_every_minutes * 60:
                    first_note_done, last_note = True, now
                    self.report(
                        self.progress_line(state, schedule, passes_total, epoch + 1, timing)
                    )
                if state.why == "finished":
                    if now >= timing.training_end(now, state.turn_passes):
                        state.why = "time"
                    elif self.should_stop():
                        state.why = "stopped"
                if state.why != "finished":
                    break
        if state.why == "stopped":
            # A stop is a stop: nothing more is trained, validated or saved.
            self.sync.leave(None, 0)
            self.report(f"stopped by the owner after {state.steps} steps")
        else:
            if state.pending:
                # The leftover gradient of a partial accumulation is applied, not thrown away.
                self.optimizer_step(state, rate())
            self.sync.leave(self.adapter_weights(), state.turn_passes - self.synced_at)
            if not state.checks or state.checks[-1].step != state.steps:
                self.validate(val, state, schedule, (self.clock() - timing.night_start) / 60)
            self.save("last", state)
            if state.kept is None:
                self.save("best", state)
            self.report(self.progress_line(state, schedule, passes_total, epoch + 1, timing))
        minutes = (self.clock() - timing.night_start) / 60
        measured = self.clock() - timing.speed_from
        kept = state.kept_check
        self.report(
            f"training stopped ({state.why}) after {state.steps} steps, {minutes:.1f} min; kept "
            + (
                f"step {kept.step} ({kept.phase}): agreement {kept.agreement}%, loss {kept.loss:.4f}"
                if kept and kept.loss is not None
                else "the last step's adapter"
            )
        )
        return TrainSummary(
            steps=state.steps,
            planned_steps=schedule.total,
            replanned_from=schedule.replanned_from,
            turn_passes=state.turn_passes,
            turns_trained=len(state.seen),
            epochs_done=round(state.turn_passes / n, 3),
            shortened=shortened,
            skipped_nan=state.skipped_nan,
            mean_loss=sum(state.losses) / len(state.losses) if state.losses else None,
            best_val_loss=kept.loss if kept else None,
            best_step=kept.step if kept else None,
            best_val_agreement=kept.agreement if kept else None,
            checks=[c.record() for c in state.checks],
            why=state.why,
            schedule=schedule.record(),
            val_turns=len(val),
            minutes=round(minutes, 2),
            final_lr=self.optimizer.param_groups[0]["lr"],
            best=str(self.out / "best"),
            last=str(self.out / "last"),
            threads=self.threads,
            turns_per_hour=round((state.turn_passes - speed_passes) * 3600 / measured, 1)
            if measured > 1 and speed_passes >= 0 and state.turn_passes > speed_passes
            else None,
            resumed_from_step=self.resumed["step"] if self.resumed else None,
            choices=self.choices.as_dict(),
            averaged=self.averaged,
            sync_minutes=round(self.sync_seconds / 60, 3),
            preparing_minutes=round(preparing / 60, 3),
            pooled_turns=self.pooled_turns,
            shared_prefix_steps=state.shared_steps,
            spared_tokens_share=round(state.spared / state.tokens, 4) if state.tokens else None,
        )


def make_optimizer(params: list, recipe: Recipe) -> torch.optim.Optimizer:
    """AdamW; Schedule-Free AdamW for that schedule (its warm-up is the schedule's rate)."""
    if recipe.schedule != "schedule-free":
        return torch.optim.AdamW(params, lr=recipe.lr, weight_decay=recipe.weight_decay)
    try:
        from schedulefree import AdamWScheduleFree
    except ImportError as e:
        raise ValueError(
            "--schedule schedule-free needs the schedulefree package (pip install schedulefree)"
        ) from e
    optimizer = AdamWScheduleFree(params, lr=recipe.lr, weight_decay=recipe.weight_decay)
    optimizer.train()
    return optimizer


def longest_batch(examples: list[Example], batch: int) -> int:
    """Tokens in the largest micro-batch these examples can make (padded to the longest)."""
    return max(len(e.input_ids) for e in examples) * min(max(1, batch), len(examples))


def optimizer_digest(optimizer) -> str:
    """A digest of the optimizer's state (moments and step counts), to compare two of them."""
    import hashlib

    digest = hashlib.sha256()
    for key, value in sorted(optimizer.state_dict()["state"].items()):
        for name, tensor in sorted(value.items()):
            digest.update(f"{key}.{name}".encode())
            digest.update(torch.as_tensor(tensor).detach().cpu().float().numpy().tobytes())
    return digest.hexdigest()
