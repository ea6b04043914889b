"""Typed settings, validated once at the edge; the recipe as written beside every artifact.

Each field's help text is its CLI help: `gbray round --help` is generated from these classes.
Device-dependent defaults (None here) are settled once by `Recipe.resolve(device)`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from gbray.paired import FallRule
from gbray.schedule import KINDS as SCHEDULES
from gbray.short_round import VAL_TURNS, Choice, Measured, short_round
from gbray.validation import KEEP_BY


def setting(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class Recipe:
    """Every setting that makes two rounds comparable. It travels with the round."""

    hours: float = setting(
        8.0, "the round's training budget in hours (the ceiling; the plan is epochs)"
    )
    epochs: float = setting(3.0, "passes over the slice")
    turns: int | None = setting(
        None,
        "slice size; default 10000 on a GPU, max(120, hours*turns_per_hour/epochs) on a CPU",
        aliases=("--slice",),
    )
    turns_per_hour: float = setting(
        40.0, "turn-passes a CPU does in an hour (a sighted turn: ~100 s a pass on a laptop)"
    )
    lr: float = setting(2e-4, "peak learning rate")
    schedule: str = setting(
        "wsd",
        "the learning rate over the night: wsd (warm-up, the peak held, then a cool-down over the "
        "last --cooldown of the time or the data, or from a plateau; good whenever the night "
        "ends), cosine (warm-up and cosine fitted to the steps the time allows; a plateau ends "
        "the night: the schedule nights had before) or schedule-free (Schedule-Free AdamW, from "
        "the schedulefree package: the peak held, the adapter its running average)",
        choices=SCHEDULES,
    )
    warmup: float = setting(0.05, "share of the steps spent in linear warm-up")
    cooldown: float = setting(
        0.2, "share of the night (its time or its slice's steps) the cool-down takes (wsd)"
    )
    min_lr_ratio: float = setting(0.1, "the rate ends at this fraction of the peak")
    batch: int = setting(1, "turns per forward pass")
    accum: int = setting(16, "forward passes per optimizer step")
    lora_r: int = setting(32, "LoRA rank")
    lora_alpha: int = setting(64, "LoRA alpha")
    lora_dropout: float = setting(0.05, "LoRA dropout")
    lora_scope: str = setting(
        "all", "all: q,k,v,o,gate,up,down; attn: q,k,v,o", choices=("all", "attn")
    )
    max_len: int = setting(4096, "tokens per turn; longer prompts are fitted, never dropped")
    answer_room: int = setting(96, "answer tokens a fitted prompt always leaves room for")
    val_turns: int = setting(
        VAL_TURNS, "held-out turns for the validation loss", aliases=("--validate-turns",)
    )
    validate_every: float | None = setting(
        None,
        "validation interval in the device's unit: minutes on a CPU, optimizer steps on a GPU "
        "(--val-every-minutes and --val-every-steps name the unit)",
    )
    val_every_minutes: float | None = setting(
        None, "minutes between validations; default 60 on a CPU, off on a GPU"
    )
    val_every_steps: int | None = setting(
        None, "optimizer steps between validations; default 200 on a GPU, off on a CPU"
    )
    patience: int = setting(
        3,
        "validations without gain that make a plateau: the cool-down starts there and the night "
        "ends when it is done (wsd), or the night ends at once (cosine)",
    )
    patience_after: float = setting(
        0.5,
        "a plateau counts only once this share of the hours is spent: a short round's noisy "
        "checks stopped one at 3.2 of its 6 minutes",
    )
    keep_by: str = setting(
        "agreement",
        "which check's adapter a night keeps: agreement (the most validation turns whose tool "
        "greedy decoding names, beyond their noise; the loss breaks ties) or loss (the lowest "
        "validation loss: it kept an adapter that names one tool for everything)",
        choices=KEEP_BY,
    )
    min_gain: float = setting(
        1e-4, "a validation loss must be lower by more than this to count as a gain"
    )
    last_every_minutes: float = setting(30.0, "minutes between last-checkpoint saves")
    progress_every_minutes: float = setting(5.0, "minutes between progress lines")
    grad_clip: float = setting(1.0, "gradient norm clip")
    weight_decay: float = setting(0.0, "AdamW weight decay")
    answer_budget: int = setting(320, "tokens the exam lets the student answer with")
    exam_turns: int | None = setting(
        None, "turns on the paper; default 150 on a CPU, 500 on a GPU", aliases=("--eval-turns",)
    )
    exam_batch: int = setting(
        64,
        "turns generated together in an exam (fewer where their cache would pass 2 GiB); a "
        "finished turn leaves its batch",
    )
    exam_full_answers: bool = setting(
        False,
        "generate every answer to EOS or the budget; by default an answer ends once it names a "
        "complete tool (greedy decoding cannot change that tool afterwards)",
    )
    tie_margin: float = setting(
        1e-4,
        "an exam step whose two best logits are closer than this is reported as a near-tie "
        "(where batching or the cached prefix could flip a token; float32 scale)",
    )
    precision: str = setting(
        "auto",
        "auto (the trainer measures: bfloat16 autocast where the CPU has native bfloat16 and a "
        "probe shows it faster, else float32; float32 on a GPU), float32, autocast (float32 "
        "weights, bfloat16 compute; the exam runs in float32) or bfloat16 (--bf16: bfloat16 "
        "weights; the exam uses the same)",
        choices=("auto", "float32", "autocast", "bfloat16"),
        shortcut=("--bf16", "bfloat16"),
    )
    threads: int = setting(0, "torch threads per actor; 0: the CPUs Ray gave the actor")
    thread_probe: bool | None = setting(
        None,
        "let the trainer run on one thread where a probe shows one faster than the actor's CPUs "
        "(cores busy with other work); default: on unless --threads is given",
    )
    gradient_checkpointing: bool | None = setting(
        None,
        "recompute activations (memory stops growing with depth, ~25%% slower); default: only "
        "when the memory free would not hold the longest turn's activations, as measured",
    )
    share_prefix: bool | None = setting(
        None,
        "run the prompt prefix that a step's turns share (the system prompt) once per optimizer "
        "step, not once per turn: the same gradients; default: on a CPU, for every step where "
        "it spares at least a tenth of the step's tokens",
    )
    seed: int | None = setting(None, "training draw seed; default from the clock, so rounds move")
    device: str = setting(
        "auto",
        "auto, cpu (--cpu) or cuda",
        choices=("auto", "cpu", "cuda"),
        shortcut=("--cpu", "cpu"),
    )

    def validate(self) -> None:
        problems = []
        if not self.hours > 0:
            problems.append("--hours must be > 0")
        if not self.epochs > 0:
            problems.append("--epochs must be > 0")
        for name in (
            "batch",
            "accum",
            "lora_r",
            "lora_alpha",
            "val_turns",
            "patience",
            "answer_budget",
            "exam_batch",
        ):
            if getattr(self, name) < 1:
                problems.append(f"--{name.replace('_', '-')} must be >= 1")
        if not 0 < self.lr < 1:
            problems.append("--lr must be between 0 and 1")
        if not 0 <= self.warmup < 1 or not 0 <= self.min_lr_ratio <= 1:
            problems.append("--warmup must be in [0, 1) and --min-lr-ratio in [0, 1]")
        if not 0 < self.cooldown < 1:
            problems.append("--cooldown must be in (0, 1)")
        if self.schedule not in SCHEDULES:
            problems.append("--schedule must be wsd, cosine or schedule-free")
        if self.keep_by not in KEEP_BY:
            problems.append("--keep-by must be agreement or loss")
        if self.max_len < self.answer_room + 32:
            problems.append("--max-len must leave room for a prompt beside --answer-room")
        if self.turns is not None and self.turns < 1:
            problems.append("--turns must be >= 1")
        if self.exam_turns is not None and self.exam_turns < 1:
            problems.append("--exam-turns must be >= 1")
        if not 0 <= self.patience_after <= 1:
            problems.append("--patience-after must be in [0, 1]")
        if not self.tie_margin >= 0:
            problems.append("--tie-margin must be >= 0")
        if self.validate_every is not None and not self.validate_every > 0:
            problems.append("--validate-every must be > 0")
        if problems:
            raise ValueError("; ".join(problems))

    def resolve(self, device: str) -> Recipe:
        """Settle the device-dependent defaults; the result is what gets recorded."""
        gpu = device == "cuda"
        turns = self.turns or (
            10_000 if gpu else max(120, math.ceil(self.hours * self.turns_per_hour / self.epochs))
        )
        minutes, steps = (0.0, 200) if gpu else (60.0, 0)
        if self.validate_every is not None:
            minutes, steps = (0.0, round(self.validate_every)) if gpu else (self.validate_every, 0)
        return dataclasses.replace(
            self,
            device=device,
            turns=turns,
            val_every_minutes=self.val_every_minutes
            if self.val_every_minutes is not None
            else minutes,
            val_every_steps=self.val_every_steps if self.val_every_steps is not None else steps,
            exam_turns=self.exam_turns or (500 if gpu else 150),
            seed=self.seed if self.seed is not None else int(time.time() * 1000) % 2**31,
            thread_probe=self.thread_probe if self.thread_probe is not None else self.threads == 0,
        )

    @property
    def weights_precision(self) -> str:
        """The dtype the weights are loaded in (training and exam): bfloat16 only when asked."""
        return "bfloat16" if self.precision == "bfloat16" else "float32"

    @property
    def lora(self) -> dict:
        return {
            "scope": self.lora_scope,
            "r": self.lora_r,
            "alpha": self.lora_alpha,
            "dropout": self.lora_dropout,
        }


DEFAULT_STUDENT = "Qwen/Qwen2.5-0.5B-Instruct"


@dataclass(frozen=True)
class ExamMode:
    """How an exam generates. `plain()` (the reference: generate() one turn at a time over the
    whole prompt, to EOS or the whole budget) is what the fast mode is checked against."""

    batch: int = 64
    stop_at_tool: bool = True
    reference: bool = False
    tie_margin: float = 1e-4

    @classmethod
    def of(cls, recipe: Recipe) -> ExamMode:
        return cls(
            batch=recipe.exam_batch,
            stop_at_tool=not recipe.exam_full_answers,
            tie_margin=recipe.tie_margin,
        )

    @classmethod
    def plain(cls, tie_margin: float = 1e-4) -> ExamMode:
        return cls(batch=1, stop_at_tool=False, reference=True, tie_margin=tie_margin)


@dataclass(frozen=True)
class RoundSettings:
    """Where a round gets its work, what it trains, where it writes."""

    model: str = setting(
        DEFAULT_STUDENT,
        "student: a model folder (from `gbray student`, or any causal LM) or a Hugging Face "
        "model id, taken from the local cache or downloaded",
    )
    out: Path = setting(None, "output folder for round.json, adapters and logs", required=True)
    data: Path | None = setting(
        None,
        "data folder with train.jsonl and eval.jsonl (with --hub: the fallback "
        "when the hub cannot be reached)",
    )
    adapter: str | None = setting(
        None,
        "carry on from this adapter: a folder, hub:NAME, or hub:serving (what the hub serves "
        "when the round starts; the bare student while nothing serves)",
    )
    hub: str | None = setting(
        None, "hub URL: take the slice and paper from it and report to it (default: $GB_HUB)"
    )
    token: str | None = setting(None, "hub bearer token (default: $GB_TOKEN, then $GBRAY_TOKEN)")
    ca: Path | None = setting(
        None,
        "certificate authority (PEM) for an https:// hub whose certificate it signed (default: "
        "$GB_CA; else the system's). A hub that cannot be verified is never sent the token: the "
        "night runs without it",
    )
    device_name: str | None = setting(
        None, "this machine's name on the hub (default: $GB_DEVICE, $COMPUTERNAME, the host name)"
    )
    fetch: bool = setting(
        True, "take the slice and paper from the hub (--no-fetch: from --data, still reporting)"
    )
    measure_only: bool = setting(
        False, "measure the start on the paper, tell the hub, and stop: no training"
    )
    skip_baseline: bool = setting(
        False, "do not measure the start: train, then examine the result only"
    )
    address: str | None = setting(None, "Ray cluster address; default: a local Ray")
    shares: int = setting(
        1, "trainers that train disjoint parts of the slice, spread over the cluster's machines"
    )
    merge_method: str = setting(
        "cat",
        "how shares are joined: cat (the exact average of the updates), svd (brought back to "
        "rank r), fedavg (A and B averaged, as the field does; inexact)",
        choices=("cat", "svd", "fedavg"),
    )
    examine_shares: bool = setting(
        False, "also examine each share's own adapter on the paper (to compare with the merge)"
    )
    share_average_minutes: float | None = setting(
        None,
        "shares sync with the night's global adapter every this many minutes of the fastest "
        "share's training (counted in turns; 0: shares meet only in the merge; default: a "
        "fortieth of --hours, at most 2)",
    )
    outer_lr: float = setting(
        1.0,
        "the averager's outer rate on what the shares moved: 1 is their average, the number of "
        "shares their sum (DiLoCo: 0.7 with --outer-momentum 0.9)",
    )
    outer_momentum: float = setting(
        0.0, "the averager's Nesterov momentum, updated once per outer step (0: none)"
    )
    step_together: bool = setting(
        True,
        "shares of about equal speed (at least 0.8 of the fastest's) step together, N "
        "machines in lockstep: every optimizer step's gradients are summed in one all-reduce "
        "between their machines (gloo over TCP) and each steps on all their turns at sqrt(N) "
        "times the rate. A share that proves slow, or is lost, ends the group and each trains "
        "on alone; a slower share or a joiner is never in it. Needs averaging",
    )
    pool_gradients: bool = setting(
        False,
        "with --no-step-together: shares pool every step's gradients, each stepping on its own "
        "and the other shares' newest (not yet taken) at sqrt(turns pooled / a whole "
        "step's) times the rate; nobody waits (needs averaging)",
    )
    share_joins: bool = setting(
        False,
        "keep a part of the slice back (one share's worth) for a machine that joins the cluster "
        "during the night: it gets a share of its own, from the current average (needs "
        "averaging)",
    )
    share_grace: float = setting(
        120.0,
        "seconds a share's machine may be gone (after another share finished) before the "
        "share is left out",
    )
    fall_points: float = setting(
        20.0,
        "a tool whose agreement falls by more than this many percentage points is flagged in "
        "the report",
    )
    fall_min_asked: int = setting(
        5, "only tools asked at least this often on the paper are flagged"
    )
    fall_min_turns: int = setting(
        5, "and only tools that lost at least this many of their turns (net) are flagged"
    )
    # Per share, extra Ray actor options (tests throttle or pin a share with them); not a flag.
    share_options: tuple = ()
    # The recipe values the student's own recipe gave, no flag: what the round may still size
    # from its data (the window). Set by the command line, which knows what was given; not a flag.
    student_chose: tuple[str, ...] = ()
    recipe: Recipe = field(default_factory=Recipe)

    def fall_rule(self) -> FallRule:
        return FallRule(self.fall_points, self.fall_min_asked, self.fall_min_turns)

    def validate(self) -> None:
        self.recipe.validate()
        problems = []
        if self.data is None and self.hub is None:
            problems.append("a round needs --data, --hub, or both")
        if self.hub and not self.token:
            problems.append("--hub needs --token (or $GB_TOKEN)")
        if self.adapter and self.adapter.startswith("hub:") and not self.hub:
            problems.append(f"--adapter {self.adapter} needs --hub")
        if self.ca is not None and not Path(self.ca).is_file():
            problems.append(f"--ca {self.ca} does not exist")
        problems += [
            f"--adapter {folder} is not an adapter folder (no adapter_config.json)"
            for folder in local_adapters(self.adapter)
            if not (Path(folder) / "adapter_config.json").is_file()
        ]
        if not self.fetch and self.data is None:
            problems.append("--no-fetch needs --data")
        if self.measure_only and self.skip_baseline:
            problems.append("--measure-only and --skip-baseline exclude each other")
        if not 1 <= self.shares <= 64:
            problems.append("--shares must be 1 to 64")
        if self.shares > 1 and self.recipe.schedule == "schedule-free":
            # Its averaged weights are not those it trains: averaging shares' would mix the two.
            problems.append("--schedule schedule-free trains one share only (shares: wsd)")
        if self.share_average_minutes is not None and not self.share_average_minutes >= 0:
            problems.append("--share-average-minutes must be >= 0")
        if not self.outer_lr > 0 or not 0 <= self.outer_momentum < 1:
            problems.append("--outer-lr must be > 0 and --outer-momentum in [0, 1)")
        if self.pool_gradients and self.share_average_minutes == 0:
            problems.append("--pool-gradients needs averaging (--share-average-minutes > 0)")
        if self.pool_gradients and self.step_together:
            problems.append(
                "--pool-gradients pools without stepping together: add --no-step-together"
            )
        if self.share_joins and self.share_average_minutes == 0:
            problems.append("--share-joins needs averaging (--share-average-minutes > 0)")
        if not self.share_grace > 0:
            problems.append("--share-grace must be > 0")
        if not 0 <= self.fall_points <= 100 or self.fall_min_asked < 1 or self.fall_min_turns < 1:
            problems.append(
                "--fall-points must be in [0, 100], --fall-min-asked and --fall-min-turns >= 1"
            )
        if problems:
            raise ValueError("; ".join(problems))


def merge_members(adapter: str | None) -> list[str]:
    """The adapters `merge:A,B,...` (the field's syntax) names; none for any other --adapter."""
    spec = adapter or ""
    return spec[len("merge:") :].split(",") if spec.startswith("merge:") else []


def local_adapters(adapter: str | None) -> list[str]:
    """The adapter folders on this machine that `--adapter` names: itself, or the local members
    of `merge:A,B,...` (hub:NAME ones are the hub's to check)."""
    members = merge_members(adapter) or [adapter]
    return [a for a in members if a and not a.startswith("hub:")]


def average_every_seconds(settings: RoundSettings) -> float:
    """How often shares sync while they train, in the fastest share's seconds: the setting,
    else a fortieth of the budget, at most two minutes (`gbray.shares.sync_turns` turns it into
    turns). Figures: the README's shares night."""
    if settings.share_average_minutes is not None:
        return settings.share_average_minutes * 60
    return default_average_seconds(settings.recipe.hours)


def default_average_seconds(hours: float) -> float:
    """A night's sync interval unless it is set: a fortieth of its hours, at most two minutes."""
    return min(120.0, hours * 3600 / 40)


def locate_model(model: str) -> tuple[Path, str]:
    """The student's folder and its name: a folder as it is (named by its folder and a hash of
    its config), or a Hugging Face model id from the local cache, else downloaded (named by its
    id). Raises ValueError in one line when neither works, before anything else starts."""
    import hashlib

    folder = Path(model).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise ValueError(f"--model {model} is not a model folder (no config.json)")
        digest = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()[:8]
        return folder.resolve(), f"{folder.resolve().name}-{digest}"
    if model.count("/") != 1 or model.startswith((".", "/", "~")):
        raise ValueError(f"--model {model} is neither a model folder nor a model id like org/name")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    wanted = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
    try:
        return Path(snapshot_download(model, local_files_only=True)), model
    except LocalEntryNotFoundError:
        pass
    except HFValidationError as e:
        raise ValueError(f"--model {model}: {e}") from e
    try:
        return Path(snapshot_download(model, allow_patterns=wanted)), model
    except Exception as e:  # noqa: BLE001 - network, auth and missing repos all end the same way
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"--model {model}: no cached copy, and it could not be downloaded ({reason})"
        ) from e


class _ValueOrShortcut(argparse.Action):
    """One setting with two spellings, one --help entry: `--precision bfloat16` or `--bf16`."""

    def __init__(self, option_strings, dest, shortcut, const, valid, **kw):
        super().__init__(option_strings, dest, nargs="?", **kw)
        self.shortcut, self.shortcut_value, self.valid = shortcut, const, valid

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string == self.shortcut:
            if values is not None:
                parser.error(f"{self.shortcut} takes no value")
            values = self.shortcut_value
        elif values is None:
            parser.error(f"{option_string} needs a value")
        elif self.valid and values not in self.valid:
            parser.error(f"{option_string}: {values!r} is not one of {', '.join(self.valid)}")
        setattr(namespace, self.dest, values)


class HelpFormatter(argparse.HelpFormatter):
    """Shows a shortcut without a value: `--precision PRECISION, --bf16`."""

    def _format_action_invocation(self, action):
        if isinstance(action, _ValueOrShortcut):
            spelled = [
                f"{o} {action.metavar}" for o in action.option_strings if o != action.shortcut
            ]
            return ", ".join([*spelled, action.shortcut])
        return super()._format_action_invocation(action)


def add_fields(
    parser: argparse.ArgumentParser,
    cls,
    title: str,
    only: tuple[str, ...] | None = None,
    description: str | None = None,
) -> None:
    """One CLI entry per dataclass field, with the field's help, default and other spellings;
    the group is described by `description`, else by the class's docstring."""
    about = description or (cls.__doc__.strip() if cls.__doc__ else None)
    group = parser.add_argument_group(title, about)
    for f in fields(cls):
        if (only is not None and f.name not in only) or "help" not in f.metadata:
            continue
        meta = f.metadata
        flags = ["--" + f.name.replace("_", "-"), *meta.get("aliases", ())]
        default = f.default if f.default is not dataclasses.MISSING else None
        kind = str(f.type)
        kwargs = {
            "help": meta["help"] + (f" (default {default})" if default is not None else ""),
            "dest": f.name,
            "default": argparse.SUPPRESS,
        }
        if "shortcut" in meta:
            shortcut, value = meta["shortcut"]
            group.add_argument(
                *flags,
                shortcut,
                action=_ValueOrShortcut,
                shortcut=shortcut,
                const=value,
                valid=meta.get("choices"),
                metavar=f.name.upper(),
                **kwargs,
            )
            continue
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
        if kind.startswith("bool"):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = (
                float
                if kind.startswith("float")
                else int
                if kind.startswith("int")
                else Path
                if kind.startswith("Path")
                else str
            )
            kwargs["required"] = meta.get("required", False)
        group.add_argument(*flags, **kwargs)


def from_args(cls, args: argparse.Namespace, hints: dict | None = None, **extra):
    """Settings from the flags given; unset fields take `hints` (a student's), then the defaults."""
    names = {f.name for f in fields(cls)}
    values = {k: v for k, v in (hints or {}).items() if k in names}
    values.update({f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
    return cls(**{**values, **extra})


def student_hints(model: str | Path, hours: float | None = None, corpus: int | None = None) -> dict:
    """Recipe settings the student suggests for a round of `hours` (student.json): see
    `student_choice`."""
    return student_choice(model, hours, corpus).values


def student_choice(
    model: str | Path, hours: float | None = None, corpus: int | None = None
) -> Choice:
    """What a student built by gbray suggests for a round of `hours`, and why: a pretrained
    student's short-round recipe from its measured speed (gbray.short_round), or the
    `recipe_hints` the student carries, then those of the first `recipe_hints_by_hours` entry
    [up to hours, hints] that the hours fit (a 10-minute round wants another recipe than a
    night). `corpus`: the turns a slice can be drawn from, where known. Nothing for a model
    folder gbray did not build."""
    import json

    path = Path(model) / "student.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return Choice({}, {})
    hours = hours if hours is not None else Recipe.hours
    if "measured" in record:
        return short_round(Measured.of(record["measured"]), hours, corpus)
    hints = dict(record.get("recipe_hints", {}))
    for up_to, more in record.get("recipe_hints_by_hours", []):
        if hours <= up_to:
            hints.update(more)
            break
    return Choice(hints, {k: "the student's own recipe_hints (student.json)" for k in hints})


def student_context(model: str | Path) -> int:
    """The longest context the student takes (its config's max_position_embeddings; SPEC's 4096
    where the config does not say)."""
    import json

    config = json.loads((Path(model) / "config.json").read_text())
    return int(config.get("max_position_embeddings") or Recipe.max_len)


def prompt_lengths(model: str | Path, turns: list[dict]) -> list[int]:
    """Each turn's chat prompt in tokens of the student's own tokenizer."""
    from transformers import AutoTokenizer

    from gbray.data.fit import chat_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [len(chat_prompt_ids(tokenizer, t["system"], t["user"])) for t in turns]


def chosen_because(choice: Choice, recipe: Recipe) -> dict:
    """Why each recipe value the student chose was taken: those a flag overrode are left out."""
    return {
        k: why for k, why in choice.why.items() if getattr(recipe, k, None) == choice.values.get(k)
    }


def as_record(obj) -> dict:
    """A settings object as plain JSON values."""
    out = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            value = as_record(value)
        elif isinstance(value, Path):
            value = str(value)
        out[f.name] = value
    return out


@dataclass(frozen=True)
class TrainerJob:
    """One trainer's start: the student and the start adapter it loads, the recipe, where it
    writes (its progress.log included) and how it names itself on the hub."""

    model: str
    start: str | None  # the start adapter's folder; None: the bare student
    start_name: str  # the start's name on the hub (`bare`, `hub:NAME`, `local:HASH`)
    recipe: Recipe
    out: Path
    run_id: str

    @property
    def log_path(self) -> Path:
        return self.out / "progress.log"

    def for_share(self, index: int) -> TrainerJob:
        return dataclasses.replace(
            self, out=self.out / f"share-{index}", run_id=f"{self.run_id}-share-{index}"
        )
