"""Building students: a tokenizer trained on the corpus, a chat template, Qwen2 weights.

`tiny` is small enough to train in minutes on two cores and is pre-trained briefly on tasks that
use no tool labels: language modelling on the corpus where half the answers name a tool drawn at
random and half repeat the first line of the latest page. It learns to read a page and to answer
with one JSON call, but not which tool a page calls for. (Random tools alone teach the answer to
ignore the page: on the demo corpus that reached 35% after the demo's round, the mix 77%.) `qwen2.5-0.5b-shape` has the real student's dimensions and random
weights: the real model's compute, for benchmarks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gbray.data.fit import Example, collate, fit_prompt
from gbray.data.turns import TurnIndex, check_folder, index_folder

log = logging.getLogger(__name__)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# What a tiny student trains well with on two cores (the demo's recipe); `gbray round` applies
# these under any flag given. The SPEC defaults are for a 0.5B student over a night. The rate is
# what the schedule holds until its cool-down: at 3e-3 a night on 40 tools and 300-token pages
# stood at 9% for 600 steps and learned only as a cosine brought it below 2e-3; held at 1e-3 it
# climbed from the start (84% of the validation turns by step 650; README, the hours curve).
TINY_HINTS = {
    "lr": 1e-3,
    "batch": 8,
    "accum": 1,
    "max_len": 1024,
    "gradient_checkpointing": False,
    "val_every_minutes": 0.5,
    "turns_per_hour": 80_000,
}

SHAPES = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        rope_theta=10000.0,
    ),
    "qwen2.5-0.5b-shape": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        vocab_size=151936,
    ),
}
_TOOL_IN_ANSWER = re.compile(r'("tool"\s*:\s*")([^"\\]+)(")')


@dataclass(frozen=True)
class StudentSettings:
    data: Path
    out: Path
    size: str = "tiny"
    vocab: int = 1536
    # Pre-training is counted in steps, so the same student is built on any machine (by time, a
    # machine 15% slower built a weaker one: the demo's gain fell from 65 to 19 points); 0: none.
    pretrain_steps: int = 450
    # When set, pre-training runs for this long instead of a number of steps.
    pretrain_seconds: float | None = None
    pretrain_max_len: int = 1024
    pretrain_lr: float = 3e-3
    pretrain_batch: int = 8
    seed: int = 0
    threads: int = 0
    # What stands in for labels in pre-training (none of them uses a turn's tool): see PRETRAIN_TASKS.
    pretrain_tools: str = "mixed"

    def validate(self) -> None:
        if self.size not in SHAPES:
            raise ValueError(f"--size must be one of {sorted(SHAPES)}")
        if not 300 <= self.vocab <= 65536:
            raise ValueError("--vocab must be between 300 and 65536")
        if self.pretrain_tools not in PRETRAIN_TASKS:
            raise ValueError(f"--pretrain-task must be one of {sorted(PRETRAIN_TASKS)}")
        if self.pretrain_seconds is not None and self.pretrain_seconds < 0:
            raise ValueError("--pretrain-seconds must be >= 0")
        if self.pretrain_steps < 0:
            raise ValueError("--pretrain-steps must be >= 0")

    @property
    def pretrains(self) -> bool:
        return (
            bool(self.pretrain_seconds)
            if self.pretrain_seconds is not None
            else (self.pretrain_steps > 0)
        )


def _sample_texts(index: TurnIndex, n: int, rng: random.Random) -> list[dict]:
    positions = rng.sample(range(len(index)), min(n, len(index)))
    return index.read(positions)


def train_tokenizer(turns: list[dict], vocab: int):
    """A byte-level BPE over the corpus text, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = (t[key] for t in turns for key in ("system", "user", "answer"))
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
    )


def build_model(size: str, tokenizer, seed: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = dict(SHAPES[size])
    rope_theta = shape.pop("rope_theta")
    vocab = shape.pop("vocab_size", None) or (len(tokenizer) + 63) // 64 * 64
    config = Qwen2Config(
        vocab_size=vocab,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        use_cache=True,
        **shape,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def _fitted_example(
    tokenizer, system: str, user: str, answer: str, max_len: int, tool: str
) -> Example:
    """Prompt fitted as in training (the page's start survives), then the answer; all labelled."""
    tail = tokenizer(answer, add_special_tokens=False)["input_ids"][: max_len // 4]
    tail = tail + [tokenizer.eos_token_id]
    prompt, shortened = fit_prompt(tokenizer, system, user, max_len - len(tail))
    ids = prompt + tail
    return Example(ids, list(ids), tool, shortened)


def pretraining_example(tokenizer, turn: dict, tool: str, max_len: int) -> Example:
    """The turn with its answer naming `tool` instead of its own."""
    answer = _TOOL_IN_ANSWER.sub(lambda m: m.group(1) + tool + m.group(3), turn["answer"], count=1)
    return _fitted_example(tokenizer, turn["system"], turn["user"], answer, max_len, tool)


READING_TASK = "Repeat the first line of the latest page."
PRETRAIN_TASKS = {
    "mixed": "language modelling on the corpus: half the turns answer naming a random tool, half repeat "
    "the first line of the latest page",
    "random": "language modelling on the corpus, answers naming random tools",
}


def first_page_line(user: str) -> str:
    """The first line of the latest page: the last blank-line block, past a header line ending in ':'."""
    lines = [line for line in user.split("\n\n")[-1].split("\n") if line.strip()]
    if len(lines) > 1 and lines[0].rstrip().endswith(":"):
        return lines[1]
    return lines[0] if lines else ""


def reading_example(tokenizer, turn: dict, max_len: int) -> Example:
    """A reading task that needs no labels: repeat the first line of the latest page."""
    return _fitted_example(
        tokenizer, READING_TASK, turn["user"], first_page_line(turn["user"]), max_len, ""
    )


def pretrain(model, tokenizer, turns: list[dict], settings: StudentSettings) -> dict:
    """Language modelling on the corpus with random tools in the answers, for a number of steps
    (or, when `pretrain_seconds` is set, a time)."""
    import torch

    rng = random.Random(settings.seed)
    tools = sorted({t["tool"] for t in turns})
    examples = []
    for turn in turns:
        if settings.pretrain_tools == "mixed" and rng.random() < 0.5:
            examples.append(reading_example(tokenizer, turn, settings.pretrain_max_len))
        else:
            examples.append(
                pretraining_example(tokenizer, turn, rng.choice(tools), settings.pretrain_max_len)
            )
    examples.sort(key=lambda e: len(e.input_ids))
    batches = [
        examples[i : i + settings.pretrain_batch]
        for i in range(0, len(examples), settings.pretrain_batch)
    ]
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.pretrain_lr, weight_decay=0.0)
    model.train()
    start, steps, losses = time.monotonic(), 0, []
    last_note = start

    def spent() -> float:
        """How much of the budget (seconds where set, else steps) is used, from 0 to 1."""
        if settings.pretrain_seconds is not None:
            return (time.monotonic() - start) / settings.pretrain_seconds
        return steps / settings.pretrain_steps

    while spent() < 1:
        rng.shuffle(batches)
        for batch in batches:
            if spent() >= 1:
                break
            # A short warm-up, then linear decay over the budget.
            frac = min(1.0, (steps + 1) / 20) * max(0.05, 1 - spent())
            for group in optimizer.param_groups:
                group["lr"] = settings.pretrain_lr * frac
            tensors = collate(batch, tokenizer.pad_token_id)
            loss = model(**tensors).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            steps += 1
            if time.monotonic() - last_note > 15:
                last_note = time.monotonic()
                log.info(
                    "pre-training: step %d, loss %.3f, %.0f%% of the budget, %.0f s in",
                    steps,
                    sum(losses[-20:]) / len(losses[-20:]),
                    100 * spent(),
                    last_note - start,
                )
    model.eval()
    tail = losses[-20:]
    return {
        "steps": steps,
        "seconds": round(time.monotonic() - start, 1),
        "final_loss": round(sum(tail) / len(tail), 4) if tail else None,
        "task": PRETRAIN_TASKS[settings.pretrain_tools],
    }


def build_student(settings: StudentSettings) -> dict:
    """Write a model folder that AutoModelForCausalLM.from_pretrained(folder) loads."""
    import torch

    from gbray.platform import set_threads

    settings.validate()
    set_threads(settings.threads)
    train, _ = index_folder(settings.data)
    rng = random.Random(settings.seed)
    turns = _sample_texts(train, 3000, rng)
    log.info("training a %d-token BPE on %d turns", settings.vocab, len(turns))
    tokenizer = train_tokenizer(turns, settings.vocab)
    model = build_model(settings.size, tokenizer, settings.seed)
    report = {
        "size": settings.size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab": len(tokenizer),
        "bad_lines": train.bad.as_dict(),
    }
    if settings.size == "tiny":
        report["recipe_hints"] = TINY_HINTS
        if settings.pretrains:
            report["pretraining"] = pretrain(model, tokenizer, turns, settings)
    settings.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float32).save_pretrained(settings.out)
    tokenizer.save_pretrained(settings.out)
    record = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()},
        **report,
    }
    (settings.out / "student.json").write_text(json.dumps(record, indent=2))
    return record


# Part of every cache key: raise it when build_student writes another student for the same
# settings and corpus, so no student built by older code is handed out.
STUDENT_FORMAT = 1


def cache_root() -> Path:
    """Where built students are kept (under students/): $GBRAY_CACHE, else
    $XDG_CACHE_HOME/gbray, else ~/.cache/gbray. Fetched wheels keep their own place
    (gbray.pretrained.default_cache), so a test session's cache never refetches one."""
    if os.environ.get("GBRAY_CACHE"):
        return Path(os.environ["GBRAY_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gbray"


def student_key(settings: StudentSettings) -> str | None:
    """What a built student is kept under: its settings (not where it is written, nor its
    threads), the corpus's bytes, and the versions that build it. None for a student pre-trained
    by the clock, which is another student on another machine."""
    if settings.pretrain_seconds is not None:
        return None
    import tokenizers
    import torch
    import transformers

    what = {k: v for k, v in asdict(settings).items() if k not in ("data", "out", "threads")}
    digest = hashlib.sha256()
    versions = (STUDENT_FORMAT, torch.__version__, transformers.__version__, tokenizers.__version__)
    digest.update(json.dumps([what, versions], sort_keys=True).encode())
    for path in check_folder(settings.data):
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()[:32]


def build_student_kept(
    settings: StudentSettings, cache: Path, fresh: bool = False
) -> tuple[dict, Path | None]:
    """The student build_student writes, copied from `cache` when one of the same key was built
    before (pre-training takes minutes; `fresh`: built anyway); else built and kept there.
    Returns its record and the folder it was copied from (None: built now)."""
    key = student_key(settings)
    if key is None:
        return build_student(settings), None
    kept = cache / "students" / key
    if not fresh and (kept / "student.json").is_file():
        shutil.copytree(kept, settings.out, dirs_exist_ok=True)
        record = json.loads((kept / "student.json").read_text())
        record["settings"]["out"] = str(settings.out)
        (settings.out / "student.json").write_text(json.dumps(record, indent=2))
        return record, kept
    record = build_student(settings)
    # Written aside and renamed, so a reader never finds half a student.
    aside = kept.with_name(f".{key}.{os.getpid()}")
    shutil.rmtree(aside, ignore_errors=True)
    shutil.copytree(settings.out, aside)
    shutil.rmtree(kept, ignore_errors=True)
    try:
        aside.rename(kept)
    except OSError:  # another process kept the same student first
        shutil.rmtree(aside, ignore_errors=True)
    return record, None
