"""Training speed and memory: gbray's trainer against the plain loop, TRL's SFTTrainer and the
fixed recipe, on the same turns with the same threads, in one run.

    python benchmarks/train_speed.py                    # the real Qwen2.5-0.5B shape, 24 layers
    python benchmarks/train_speed.py --layers 6 --turns 2
    python benchmarks/train_speed.py --shared-tokens 0  # turns that share nothing

Variants, each in its own process (so each peak RSS is its own):
  gbray   gbray's trainer as it configures itself (autocast and checkpointing measured; the
          prompt prefix a step's turns share run once a step)
  plain   the plain loop: `model(input_ids, labels=...)`, backward, AdamW; the same LoRA through
          PEFT as it comes (its own dropout modules), float32, and the checkpointing gbray chose
  trl     TRL's SFTTrainer with its own defaults, the same LoRA, completion-only loss (needs
          `pip install trl`; left out with the reason when it is missing)
  fixed   gbray's trainer with SPEC §5's fixed recipe: float32, checkpointing on, every turn
          run whole (no shared prefix)

Every turn is --prompt-tokens of prompt and --answer-tokens of answer (random ids: speed does not
depend on the words); the first --shared-tokens of every prompt are the same ids, as every real
turn begins with the same system prompt (the tool catalogue). The default, 1,972 of 2,048, is
the share issue 9 measured on the field's turns (a 2,600-token shared prefix in 2,700-token
turns). An optimizer step is --accum turns (SPEC §5: 16). gbray is timed over --steps optimizer
steps after one of warm-up; the others, which run a turn at a time, over --turns turns after one
(and an optimizer step). Prints one JSON object: seconds a turn, turns an hour and peak RSS of
each, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

LORA = dict(r=32, alpha=64, dropout=0.05, scope="all")
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def student(args) -> Path:
    """The Qwen2.5-0.5B shape with random weights, --layers deep, built once under --work."""
    out = args.work / f"qwen-shape-{args.layers}-layers"
    if (out / "config.json").is_file():
        return out
    from gbray.data.synth import SynthSettings, write_corpus
    from gbray.student import SHAPES, build_model, train_tokenizer

    data = args.work / "corpus"
    if not (data / "train.jsonl").is_file():
        write_corpus(SynthSettings(out=data, turns=300, eval_turns=20, seed=1))
    from gbray.data.turns import index_folder

    train, _ = index_folder(data)
    tokenizer = train_tokenizer(train.read(list(range(200))), 1024)
    SHAPES["bench"] = {**SHAPES["qwen2.5-0.5b-shape"], "num_hidden_layers": args.layers}
    model = build_model("bench", tokenizer, seed=0)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def turns(args, vocab: int, n: int):
    import torch

    from gbray.data.fit import IGNORE, Example

    g = torch.Generator().manual_seed(0)
    length = args.prompt_tokens + args.answer_tokens
    shared = torch.randint(10, vocab, (args.shared_tokens,), generator=g).tolist()
    made = []
    for _ in range(n):
        own = length - args.shared_tokens
        ids = shared + torch.randint(10, vocab, (own,), generator=g).tolist()
        labels = [IGNORE] * args.prompt_tokens + ids[args.prompt_tokens :]
        made.append(Example(ids, labels, "t", False))
    return made


def recipe_for(args, variant: str):
    from gbray.settings import Recipe

    fixed = variant == "fixed"
    return Recipe(
        hours=10.0, epochs=1, lr=2e-4, batch=1, accum=args.accum, lora_r=LORA["r"],
        lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
        max_len=args.prompt_tokens + args.answer_tokens + 8, answer_room=args.answer_tokens,
        threads=args.threads, device="cpu", seed=0,
        precision="float32" if fixed else "auto",
        gradient_checkpointing=True if fixed else None, share_prefix=False if fixed else None,
    )  # fmt: skip


def gbray_step(args, recipe, model_dir: Path, out: Path, turns_a_call: int):
    """gbray's trainer configured as it configures itself: (trainer, its choices, a function
    that runs `turns_a_call` turns through the trainer's accumulation and one optimizer step)."""
    from gbray.trainer import Trainer, TrainState

    trainer = Trainer(str(model_dir), None, recipe, out)
    examples = turns(args, trainer.model.get_input_embeddings().num_embeddings, turns_a_call)
    choices = trainer.configure(len(examples[0].input_ids))
    state = TrainState()

    def step():
        trainer.accumulate([[e] for e in examples], state)
        trainer.optimizer_step(state, recipe.lr)

    return trainer, choices, step


def time_gbray(args, variant: str, model_dir: Path) -> dict:
    recipe = recipe_for(args, variant)
    if variant == "fixed":  # a turn at a time: timed by the turn, as the plain loop is
        _, choices, one = gbray_step(args, recipe, model_dir, args.work / "out-fixed", 1)
        return {**timed(one, args.turns, 1), "choices": choices.as_dict()}
    _, choices, window = gbray_step(args, recipe, model_dir, args.work / "out-gbray", args.accum)
    return {**timed(window, args.steps, args.accum), "choices": choices.as_dict()}


def time_plain(args, model_dir: Path, checkpointing: bool) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model

    from gbray.model import SCOPES, load_base, lora_targets
    from gbray.platform import set_threads

    set_threads(args.threads)
    base, _ = load_base(str(model_dir), "float32")
    # PEFT as it comes (its own dropout modules), not gbray's wrap_lora
    lora = LoraConfig(
        r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"], bias="none",
        target_modules=lora_targets(base, SCOPES[LORA["scope"]]), task_type="CAUSAL_LM",
    )  # fmt: skip
    model = get_peft_model(base, lora)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    example = turns(args, model.get_input_embeddings().num_embeddings, 1)[0]
    ids = torch.tensor([example.input_ids])
    labels = torch.tensor([example.labels])

    def step():
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return {**timed(step, args.turns, 1), "checkpointing": checkpointing}


def time_trl(args, model_dir: Path) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    examples = turns(args, model.get_input_embeddings().num_embeddings, 1 + args.turns)
    # Already tokenized, with the completion mask: the loss is on the answer only.
    data = Dataset.from_list(
        [
            {
                "input_ids": e.input_ids,
                "completion_mask": [0] * args.prompt_tokens + [1] * args.answer_tokens,
            }
            for e in examples
        ]
    )
    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_a, **_k):
            stamps.append(time.perf_counter())

    config = SFTConfig(
        output_dir=str(args.work / "out-trl"), max_steps=1 + args.turns,
        per_device_train_batch_size=1, gradient_accumulation_steps=1, learning_rate=2e-4,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        max_length=args.prompt_tokens + args.answer_tokens, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[Clock()],
        peft_config=LoraConfig(
            r=LORA["r"],
            lora_alpha=LORA["alpha"],
            lora_dropout=LORA["dropout"],
            target_modules=PROJECTIONS,
            task_type="CAUSAL_LM",
        ),  # fmt: skip
    )
    started = time.perf_counter()
    trainer.train()
    del started  # the first step (warm-up) is not timed
    seconds = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
    return {
        "seconds_per_turn": round(seconds, 2),
        "turns_per_hour": round(3600 / seconds, 1),
        "defaults": {
            "bf16": config.bf16,
            "gradient_checkpointing": config.gradient_checkpointing,
            "completion_only_loss": config.completion_only_loss,
        },
    }


def timed(step, calls: int, turns_a_call: int) -> dict:
    """`step` run once to warm up, then `calls` times on the clock."""
    step()
    started = time.perf_counter()
    for _ in range(calls):
        step()
    seconds = (time.perf_counter() - started) / (calls * turns_a_call)
    return {
        "seconds_per_turn": round(seconds, 2),
        "turns_per_hour": round(3600 / seconds, 1),
        "timed_turns": calls * turns_a_call,
    }


def child(args) -> None:
    model_dir = Path(args.model_dir)
    if args.variant in ("gbray", "fixed"):
        out = time_gbray(args, args.variant, model_dir)
    elif args.variant == "plain":
        out = time_plain(args, model_dir, args.checkpointing)
    else:
        out = time_trl(args, model_dir)
    out["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2, 2)
    print("RESULT " + json.dumps(out), flush=True)


def run_child(args, variant: str, model_dir: Path, checkpointing: bool = False) -> dict:
    cmd = [
        sys.executable, __file__, "--child", "--variant", variant, "--model-dir", str(model_dir),
        "--layers", str(args.layers), "--steps", str(args.steps), "--turns", str(args.turns),
        "--prompt-tokens", str(args.prompt_tokens), "--answer-tokens", str(args.answer_tokens),
        "--shared-tokens", str(args.shared_tokens), "--accum", str(args.accum),
        "--threads", str(args.threads), "--work", str(args.work),
    ] + (["--checkpointing"] if checkpointing else [])  # fmt: skip
    print(f"timing {variant} ...", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"error": " | ".join(tail)[:600]}
    return json.loads(line[len("RESULT ") :])


def ratio(a: dict, b: dict, key: str, invert: bool = False):
    if key not in a or key not in b:
        return None
    return round((b[key] / a[key]) if invert else (a[key] / b[key]), 2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=24, help="decoder layers (24: the real shape)")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--answer-tokens", type=int, default=64)
    p.add_argument(
        "--shared-tokens", type=int, default=1972,
        help="prompt tokens every turn shares (the system prompt); default: issue 9's share",
    )  # fmt: skip
    p.add_argument("--accum", type=int, default=16, help="turns an optimizer step (SPEC §5)")
    p.add_argument("--steps", type=int, default=1, help="gbray: timed optimizer steps")
    p.add_argument("--turns", type=int, default=4, help="the others: timed turns")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--work", type=Path, default=Path("/tmp/gbray-train-speed"))
    p.add_argument("--variants", default="gbray,plain,trl,fixed")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not 0 <= args.shared_tokens < args.prompt_tokens:
        p.error("--shared-tokens must be at least 0 and below --prompt-tokens")
    if min(args.accum, args.steps, args.turns, args.layers) < 1:
        p.error("--accum, --steps, --turns and --layers must be at least 1")
    args.work.mkdir(parents=True, exist_ok=True)
    if args.child:
        child(args)
        return 0
    model_dir = student(args)
    wanted = args.variants.split(",")
    results = {}
    if "gbray" in wanted:
        results["gbray"] = run_child(args, "gbray", model_dir)
    if "plain" in wanted:
        same = bool(results.get("gbray", {}).get("choices", {}).get("checkpointing", False))
        results["plain"] = run_child(args, "plain", model_dir, checkpointing=same)
    if "trl" in wanted:
        try:
            import trl  # noqa: F401

            results["trl"] = run_child(args, "trl", model_dir)
        except ImportError:
            results["trl"] = {"error": "trl is not installed (pip install trl)"}
    if "fixed" in wanted:
        results["fixed"] = run_child(args, "fixed", model_dir)
    g = results.get("gbray", {})
    print(
        json.dumps(
            {
                "benchmark": "train_speed",
                "layers": args.layers,
                "tokens_per_turn": args.prompt_tokens + args.answer_tokens,
                "shared_tokens": args.shared_tokens,
                "accum": args.accum,
                "threads": args.threads,
                **results,
                "ratios": {
                    "gbray_vs_trl_turns_per_hour": ratio(
                        g, results.get("trl", {}), "turns_per_hour"
                    ),
                    "gbray_vs_fixed_turns_per_hour": ratio(
                        g, results.get("fixed", {}), "turns_per_hour"
                    ),
                    "gbray_vs_plain_peak_rss": ratio(g, results.get("plain", {}), "peak_rss_gb"),
                    "gbray_vs_plain_turns_per_hour": ratio(
                        g, results.get("plain", {}), "turns_per_hour"
                    ),
                },
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
