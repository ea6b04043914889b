"""Head-only answer loss vs the model's own loss: peak memory and time of one forward+backward.

Real Qwen2.5-0.5B width and vocabulary (151,936), random weights, a LoRA on all projections, one
sighted-length turn (2,700 prompt tokens, 60 answer tokens). Each variant runs in a fresh process
so its peak RSS is its own. Prints JSON: the figure (head-only), the baseline (model's own loss,
full-vocabulary logits), and their ratio.

    python benchmarks/answer_loss.py [--layers 2] [--prompt 2700] [--answer 60]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def one(variant: str, layers: int, prompt: int, answer: int) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from gbray.model import answer_loss, wrap_lora

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = wrap_lora(Qwen2ForCausalLM(config), "all", 32, 64, 0.0)
    ids = torch.randint(0, 151936, (1, prompt + answer))
    labels = ids.clone()
    labels[:, :prompt] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    loss = answer_loss(model, batch)[0] if variant == "head_only" else model(**batch).loss
    loss.backward()
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "variant": variant,
        "seconds": round(seconds, 2),
        "peak_rss_mb": round(peak / 1024),
        "step_rss_mb": round((peak - before) / 1024),
        "loss": round(loss.item(), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=2700)
    parser.add_argument("--answer", type=int, default=60)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(one(args.variant, args.layers, args.prompt, args.answer)))
        return
    results = {}
    for variant in ("model_loss", "head_only"):
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--variant",
                variant,
                "--layers",
                str(args.layers),
                "--prompt",
                str(args.prompt),
                "--answer",
                str(args.answer),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    figure, baseline = results["head_only"], results["model_loss"]
    print(
        json.dumps(
            {
                "benchmark": "answer_loss",
                "layers": args.layers,
                "prompt": args.prompt,
                "answer": args.answer,
                "figure": figure,
                "baseline": baseline,
                "ratio_step_memory": round(
                    figure["step_rss_mb"] / max(1, baseline["step_rss_mb"]), 3
                ),
                "ratio_seconds": round(figure["seconds"] / baseline["seconds"], 3),
                "same_loss": abs(figure["loss"] - baseline["loss"]) < 1e-3,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
