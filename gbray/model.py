"""Loading a student by its architecture, finding LoRA targets, and the answer-only loss."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from gbray.data.fit import IGNORE

log = logging.getLogger(__name__)

SCOPES = {
    "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
}
# Towers of multimodal students that a text round never adapts.
SKIPPED_TOWERS = ("vision", "visual", "audio", "image")


def dtype_for(precision: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        precision
    ]


def load_base(model_path: str | Path, precision: str = "float32"):
    """The model class its config names, falling back to the causal-LM loader."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(model_path)
    dtype = dtype_for(precision)
    model = None
    for name in config.architectures or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            try:
                model = cls.from_pretrained(model_path, dtype=dtype)
                break
            except (ValueError, TypeError, OSError) as e:
                log.info(
                    "loading %s as %s failed (%s); using the causal-LM loader", model_path, name, e
                )
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def lora_targets(model: nn.Module, wanted: tuple[str, ...]) -> list[str]:
    """Full names of the Linear layers to adapt.

    A wanted name on a plain Linear is used as is; a wrapper with exactly one Linear child (Gemma 4's
    clippable linear) is adapted through that child; vision, audio and image towers are skipped.
    """
    targets = []
    for name, module in model.named_modules():
        parts = name.split(".")
        if parts[-1] not in wanted or any(t in p.lower() for p in parts for t in SKIPPED_TOWERS):
            continue
        if isinstance(module, nn.Linear):
            targets.append(name)
            continue
        linears = [(n, m) for n, m in module.named_modules() if n and isinstance(m, nn.Linear)]
        if len(linears) == 1:
            targets.append(f"{name}.{linears[0][0]}")
    return targets


def wrap_lora(model, scope: str, r: int, alpha: int, dropout: float):
    from peft import LoraConfig, get_peft_model

    targets = lora_targets(model, SCOPES[scope])
    if not targets:
        raise ValueError(f"no LoRA targets for scope {scope!r} in {type(model).__name__}")
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return fold_lora_dropout(get_peft_model(model, config))


def _kept(x: torch.Tensor, p: float, seed: int) -> tuple[torch.Tensor, float]:
    """The dropout mask drawn from `seed` (True: kept) and the scale of what is kept: the same
    mask every time it is asked for.

    Each 16 random bits decide one element, p rounded to 1/65536: one 64-bit draw for four
    elements ran 4x faster here than bernoulli_, whose one draw each was most of the dropout's
    cost on a CPU.
    """
    generator = torch.Generator(device=x.device).manual_seed(seed)
    n = x.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=x.device)
    words.random_(-(2**63), 2**63 - 1, generator=generator)
    dropped = round(p * 65536)
    keep = words.view(torch.int16)[:n].view(x.shape) >= dropped - 32768
    return keep, 65536 / (65536 - dropped)


class _DropoutThenLinear(torch.autograd.Function):
    """dropout(x) @ W.T that keeps x and a seed for backward, not the dropped copy and its mask.

    PEFT's dropout module makes one dropped copy of a layer's input per adapted projection (q, k
    and v each drop the same input), and autograd keeps each copy and its mask until backward:
    at dropout 0.05 that was half again the bytes saved for backward. Here backward draws the
    mask again from the seed, and x is the tensor the other projections keep anyway. The scale
    is applied to the rank-r side, the small one.
    """

    @staticmethod
    def forward(ctx, x, weight, p, seed, dtype):
        ctx.save_for_backward(x, weight)
        ctx.p, ctx.seed, ctx.dtype = p, seed, dtype
        keep, scale = _kept(x, p, seed)
        with torch.autocast(x.device.type, enabled=False):  # dtype is what autocast would pick
            kept = torch.where(keep, x, 0).to(dtype)
            return nn.functional.linear(kept, weight.to(dtype)) * scale

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        keep, scale = _kept(x, ctx.p, ctx.seed)
        grad = grad.to(ctx.dtype) * scale
        with torch.autocast(x.device.type, enabled=False):
            grad_x = None
            if ctx.needs_input_grad[0]:
                grad_x = torch.where(keep, (grad @ weight.to(ctx.dtype)).to(x.dtype), 0)
            kept = torch.where(keep, x, 0).to(ctx.dtype).reshape(-1, x.shape[-1])
            grad_w = (grad.reshape(-1, grad.shape[-1]).T @ kept).to(weight.dtype)
        return grad_x, grad_w, None, None, None


class DropoutLinear(nn.Linear):
    """LoRA's A matrix with the adapter's input dropout inside it (training only); its weight
    is the same parameter under the same name, so adapter files are PEFT's own."""

    p: float = 0.0

    def forward(self, x):
        if not (self.training and self.p > 0 and torch.is_grad_enabled()):
            return nn.functional.linear(x, self.weight)
        device = x.device.type
        dtype = self.weight.dtype
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
        # Drawn from torch's generator, so checkpointing's replay of the forward draws it again.
        seed = int(torch.randint(0, 2**62, ()))
        return _DropoutThenLinear.apply(x, self.weight, self.p, seed, dtype)


def fold_lora_dropout(model):
    """Every plain LoRA layer's dropout moved into its A matrix (DropoutLinear); returns model."""
    from peft.tuners.lora.layer import LoraLayer

    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        for name, dropout in list(module.lora_dropout.items()):
            a = module.lora_A[name]
            if (
                not isinstance(dropout, nn.Dropout)
                or type(a) is not nn.Linear
                or a.bias is not None
            ):
                continue
            folded = DropoutLinear(a.in_features, a.out_features, bias=False, device="meta")
            folded.weight, folded.p = a.weight, dropout.p
            module.lora_A[name] = folded
            module.lora_dropout[name] = nn.Identity()
    return model


def load_student(
    model_path, adapter: str | None, precision: str, trainable: bool, lora: dict | None = None
):
    """The student ready for a round: carried-on adapter (its own shape wins) or a fresh LoRA."""
    from peft import PeftModel

    base, tokenizer = load_base(model_path, precision)
    if adapter:
        model = PeftModel.from_pretrained(base, str(adapter), is_trainable=trainable)
        if trainable:
            fold_lora_dropout(model)
    elif lora is not None:
        model = wrap_lora(base, **lora)
    else:
        model = base
    return model, tokenizer


def body_and_head(model):
    """The transformer body and LM head of a (possibly PEFT-wrapped) causal LM, or None."""
    inner = model
    if hasattr(inner, "get_base_model"):
        inner = inner.get_base_model()
    body = getattr(inner, "model", None)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if isinstance(body, nn.Module) and isinstance(head, nn.Module):
        return body, head
    return None


def answer_loss(model, batch: dict) -> tuple[torch.Tensor, int]:
    """Mean cross-entropy over labelled tokens, and how many there were.

    The LM head runs only where the next token is labelled, in float32: full-vocabulary logits
    for 4,096 positions are 2.5 GB in float32 and ran a 24 GB card out of memory. Architectures
    without the usual body + head use the model's own loss.
    """
    labels = batch["labels"]
    targets = labels[:, 1:]
    keep = targets != IGNORE
    count = int(keep.sum())
    parts = body_and_head(model)
    if parts is None:
        out = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels
        )
        return out.loss, count
    body, head = parts
    hidden = body(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
    ).last_hidden_state
    picked = hidden[:, :-1][keep]
    logits = head(picked).float()
    # An all-masked batch gives 0/0 = NaN here, which the trainer's guard counts and skips.
    loss = (
        nn.functional.cross_entropy(logits, targets[keep], reduction="sum") / count
        if count
        else logits.sum() * float("nan")
    )
    return loss, count


def tool_named(
    logits: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor, tool_tokens: torch.Tensor
) -> torch.Tensor:
    """Per row, whether greedy decoding would name the recorded tool: every one of the row's
    first `tool_tokens` labelled tokens is the argmax of its logits (teacher forcing follows
    greedy decoding exactly as far as they agree). `logits` are those of the labelled positions
    (`keep`, row by row); a row with no tool to check (0) counts as not named."""
    hit = logits.argmax(dim=-1) == targets[keep]
    rank = (keep.cumsum(dim=1) - 1)[keep]  # each labelled position's place in its row's answer
    row = torch.arange(keep.shape[0], device=keep.device)[:, None].expand_as(keep)[keep]
    needed = rank < tool_tokens[row]
    missed = torch.zeros(keep.shape[0], dtype=torch.long, device=keep.device)
    missed = missed.index_add(0, row, (needed & ~hit).long())
    return (missed == 0) & (tool_tokens > 0) & (keep.sum(dim=1) >= tool_tokens)


def validation_rows(model, batch: dict, tool_tokens: torch.Tensor):
    """Per row: summed cross-entropy over the labelled tokens, their count, and whether greedy
    decoding would name the recorded tool (`tool_named`). Forward only."""
    labels = batch["labels"]
    targets = labels[:, 1:]
    keep = targets != IGNORE
    parts = body_and_head(model)
    if parts is None:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        logits = out.logits[:, :-1][keep].float()
    else:
        body, head = parts
        hidden = body(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).last_hidden_state
        logits = head(hidden[:, :-1][keep]).float()
    per_token = nn.functional.cross_entropy(logits, targets[keep], reduction="none")
    row = torch.arange(keep.shape[0], device=keep.device)[:, None].expand_as(keep)[keep]
    sums = torch.zeros(keep.shape[0], device=keep.device, dtype=per_token.dtype)
    sums = sums.index_add(0, row, per_token)
    return sums, keep.sum(dim=1), tool_named(logits, targets, keep, tool_tokens)
