"""Training on turns that share the first tokens of their prompt: the prefix computed once.

Every turn of a corpus begins with the same system prompt (the tool catalogue), and every turn of
one optimizer step is computed with the same weights. So within a step the shared prefix is run
once (batch of one) and each turn's own part, its *row*, attends to the prefix's keys and values
and to its own, causally: the gradient is the one turn-by-turn training computes, with the
prefix's tokens run once instead of once per turn (16 turns a step whose 2,112-token prompts
share 1,972 tokens run 4,244 tokens instead of 33,792).

How a step runs (`shared_prefix_losses`):
1. The prefix runs with every decoder layer checkpointed; each layer's keys and values after
   RoPE are kept (`PrefixKeys`). Only the layers' inputs are held, not the prefix's activations
   (as many tokens as one turn), so the step's memory is one group of rows.
2. The rows run in groups of whole micro-batches under a token budget, attending to detached
   copies of those keys and values (`prefix_attention`); each group's loss is back-propagated
   at once, adding to the adapter's gradient and to the prefix keys' and values' gradients.
3. Those gradients are back-propagated through the prefix once (its layers recomputed).

The loss is what turn-by-turn training computes: each micro-batch's mean over its labelled
tokens, divided by the accumulation. What differs is only where dropout draws its masks: LoRA's
dropout on the prefix draws one mask for the step's turns where turn-by-turn draws one a turn.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from gbray.data.fit import IGNORE, Example
from gbray.model import body_and_head, tool_named

SHARED_PREFIX = "gbray_shared_prefix"
# A step shares its prefix only where that spares at least this share of its tokens.
MIN_SAVING = 0.1
# Tokens of rows run together in one group (whole micro-batches; at least one micro-batch).
GROUP_TOKENS = 512


@dataclass
class PrefixKeys:
    """Each decoder layer's keys and values over the prefix (batch of one), by layer index."""

    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)

    def detached(self) -> PrefixKeys:
        """Leaf copies the rows attend to; their gradients are the prefix's to back-propagate.
        A tensor that no adapter reaches (the first layer's keys where k_proj has none) needs
        no gradient."""
        return PrefixKeys(
            {i: k.detach().requires_grad_(k.requires_grad) for i, k in self.keys.items()},
            {i: v.detach().requires_grad_(v.requires_grad) for i, v in self.values.items()},
        )

    def gradients(self, leaves: PrefixKeys) -> tuple[list, list]:
        """(tensors, their gradients) of what the rows back-propagated into `leaves`."""
        pairs = [
            (mine[i], theirs[i].grad)
            for mine, theirs in ((self.keys, leaves.keys), (self.values, leaves.values))
            for i in mine
            if theirs[i].grad is not None
        ]
        return [t for t, _ in pairs], [g for _, g in pairs]


def _flash(query, key, value, causal: bool, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, causal, scale=scale
    )


def _flash_backward(grad, query, key, value, out, lse, causal: bool, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, query, key, value, out, lse, 0.0, causal, scale=scale
    )


def _one_long_row(t: torch.Tensor) -> torch.Tensor:
    """(rows, heads, length, ...) -> (1, heads, rows * length, ...): every row's queries
    against the one copy of the prefix."""
    rows, heads, length = t.shape[:3]
    return t.transpose(0, 1).reshape(1, heads, rows * length, *t.shape[3:])


def _rows_again(t: torch.Tensor, rows: int) -> torch.Tensor:
    heads = t.shape[1]
    return t.reshape(heads, rows, -1, *t.shape[3:]).transpose(0, 1)


class _PrefixAndOwn(torch.autograd.Function):
    """Attention of each row's queries over the prefix's keys (all of them) and the row's own
    (causally), joined exactly by their log-sum-exps; PyTorch's fused CPU flash kernel for
    both parts, forward and backward.

    Backward runs the fused backward of each part with the *joined* output and log-sum-exp: with
    those, each part's probabilities are the joined softmax's and its row sums are the joined
    ones, which is the exact gradient of the whole (as split-key flash attention does)."""

    @staticmethod
    def forward(ctx, query, prefix_key, prefix_value, key, value, scale):
        rows = query.shape[0]
        own_out, own_lse = _flash(query, key, value, True, scale)
        p_out, p_lse = _flash(_one_long_row(query), prefix_key, prefix_value, False, scale)
        p_out, p_lse = _rows_again(p_out, rows), _rows_again(p_lse, rows)
        lse = torch.logaddexp(own_lse, p_lse)
        out = own_out * torch.exp(own_lse - lse)[..., None].to(own_out.dtype) + p_out * torch.exp(
            p_lse - lse
        )[..., None].to(p_out.dtype)
        ctx.save_for_backward(query, prefix_key, prefix_value, key, value, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        query, prefix_key, prefix_value, key, value, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        rows = query.shape[0]
        g_query, g_key, g_value = _flash_backward(
            grad, query, key, value, out, lse, True, ctx.scale
        )
        flat = [_one_long_row(t).contiguous() for t in (grad, query, out)]
        g_pq, g_pkey, g_pvalue = _flash_backward(
            flat[0], flat[1], prefix_key, prefix_value, flat[2],
            _one_long_row(lse).contiguous(), False, ctx.scale,
        )  # fmt: skip
        return g_query + _rows_again(g_pq, rows), g_pkey, g_pvalue, g_key, g_value, None


def _repeat_heads(t: torch.Tensor, group: int) -> torch.Tensor:
    # Heads h*group .. h*group+group-1 read key head h, as transformers' repeat_kv lays them out.
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def prefix_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw
) -> tuple[torch.Tensor, None]:
    """The trainer's attention function: SDPA, as the model runs without it, unless a step
    shares a prefix. `prefix_capture` (the prefix's pass): the layer's keys and values are
    kept. `prefix_keys` (the rows' pass): rows attend to the prefix and, causally, to
    themselves (right-padded, so a real token never sees padding; `attention_mask` is unused)."""
    capture: PrefixKeys | None = kw.pop("prefix_capture", None)
    prefix: PrefixKeys | None = kw.pop("prefix_keys", None)
    if capture is not None and module.layer_idx not in capture.keys:
        # A checkpointed layer's replay in backward runs this again: the first pass's are kept.
        capture.keys[module.layer_idx], capture.values[module.layer_idx] = key, value
    if prefix is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kw
        )
    if dropout or query.device.type != "cpu":
        raise NotImplementedError(
            "shared-prefix attention runs on a CPU, without attention dropout"
        )
    group = query.shape[1] // key.shape[1]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    pk, pv = prefix.keys[module.layer_idx], prefix.values[module.layer_idx]
    dtype = query.dtype  # under autocast the projections give bfloat16, the prefix likewise
    out = _PrefixAndOwn.apply(
        query,
        _repeat_heads(pk.to(dtype), group),
        _repeat_heads(pv.to(dtype), group),
        _repeat_heads(key.to(dtype), group),
        _repeat_heads(value.to(dtype), group),
        scale,
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(SHARED_PREFIX, prefix_attention)
AttentionMaskInterface.register(SHARED_PREFIX, sdpa_mask)


# Architectures whose attention is plain causal SDPA over every earlier token (no sliding
# window, soft-capping or sinks), which `prefix_attention` computes exactly.
ARCHITECTURES = ("qwen2", "qwen3", "llama")


def use_prefix_attention(model) -> bool:
    """Set the trainer's attention function on a (PEFT-wrapped) model, where it computes what the
    model's own does: one of ARCHITECTURES on SDPA, no attention dropout, no sliding window.
    Returns whether it was set."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if config is None or getattr(config, "model_type", None) not in ARCHITECTURES:
        return False
    if getattr(config, "_attn_implementation", None) not in ("sdpa", None):
        return False
    if getattr(config, "attention_dropout", 0.0) or getattr(config, "use_sliding_window", False):
        return False
    try:
        base.set_attn_implementation(SHARED_PREFIX)
    except (ValueError, AttributeError):
        return False
    return True


# -- which turns share what -------------------------------------------------------------------


def common_prefix(examples: list[Example]) -> int:
    """Tokens every example's prompt begins with, leaving each at least its last prompt token
    (it predicts the first answer token, so it must be a row's)."""
    first = examples[0].input_ids
    n = min(_prompt_length(e) for e in examples) - 1
    for e in examples[1:]:
        ids = e.input_ids
        i = 0
        while i < n and ids[i] == first[i]:
            i += 1
        n = i
    return max(0, n)


def _prompt_length(e: Example) -> int:
    return next((i for i, label in enumerate(e.labels) if label != IGNORE), len(e.labels))


def saving(micro_batches: list[list[Example]], prefix: int) -> float:
    """Share of a step's tokens that running the prefix once spares."""
    turns = [e for batch in micro_batches for e in batch]
    total = sum(len(e.input_ids) for e in turns)
    return (len(turns) - 1) * prefix / total if total else 0.0


def prefix_to_share(micro_batches: list[list[Example]]) -> int:
    """Tokens a step's turns run once: their common prefix where it spares at least MIN_SAVING
    of the step's tokens, else 0 (the turns run whole)."""
    turns = [e for batch in micro_batches for e in batch]
    prefix = common_prefix(turns) if len(turns) > 1 else 0
    return prefix if prefix and saving(micro_batches, prefix) >= MIN_SAVING else 0


def groups(micro_batches: list[list[Example]], prefix: int, budget: int = GROUP_TOKENS):
    """Micro-batches gathered into groups of rows of at most `budget` tokens (at least one)."""
    out, current, size = [], [], 0
    for batch in micro_batches:
        tokens = sum(len(e.input_ids) - prefix for e in batch)
        if current and size + tokens > budget:
            out.append(current)
            current, size = [], 0
        current.append(batch)
        size += tokens
    if current:
        out.append(current)
    return out


# -- one step ---------------------------------------------------------------------------------


def _body_and_head(model):
    parts = body_and_head(model)
    if parts is None:
        raise ValueError("shared-prefix training needs a model with the usual body and head")
    return parts


@contextlib.contextmanager
def _layers_checkpointed(body: nn.Module):
    """Every decoder layer checkpointed (non-reentrant) for the forwards inside, then as before."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in body.modules() if isinstance(m, GradientCheckpointingLayer)]
    before = [
        (m.gradient_checkpointing, getattr(m, "_gradient_checkpointing_func", None)) for m in layers
    ]
    for m in layers:
        m.gradient_checkpointing = True
        m._gradient_checkpointing_func = partial(
            torch.utils.checkpoint.checkpoint, use_reentrant=False
        )
    try:
        yield
    finally:
        for m, (flag, func) in zip(layers, before, strict=True):
            m.gradient_checkpointing = flag
            if func is None:
                del m._gradient_checkpointing_func
            else:
                m._gradient_checkpointing_func = func


def run_prefix(model, ids: list[int], device: str, recompute: bool) -> PrefixKeys:
    """Each layer's keys and values over `ids`; with `recompute`, only the layers' inputs are
    kept for backward (the layers run again there)."""
    body, _ = _body_and_head(model)
    captured = PrefixKeys()
    tensor = torch.tensor([ids], device=device)
    with _layers_checkpointed(body) if recompute else contextlib.nullcontext():
        body(input_ids=tensor, prefix_capture=captured, use_cache=False)
    return captured


def _rows(examples: list[Example], prefix: int, pad_id: int, device: str):
    """Right-padded rows (each turn past the prefix), their labels, and their positions."""
    width = max(len(e.input_ids) - prefix for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.input_ids) - prefix
        ids[row, :n] = torch.tensor(e.input_ids[prefix:])
        labels[row, :n] = torch.tensor(e.labels[prefix:])
    positions = torch.arange(prefix, prefix + width).expand(len(examples), -1)
    return ids.to(device), labels.to(device), positions.to(device)


def row_losses(
    model, examples, prefix: int, keys: PrefixKeys, pad_id: int, device: str, named: bool = False
):
    """Summed cross-entropy over each row's labelled tokens, and their counts (one each); with
    `named`, also whether greedy decoding would name each row's recorded tool (validation)."""
    body, head = _body_and_head(model)
    ids, labels, positions = _rows(examples, prefix, pad_id, device)
    hidden = body(input_ids=ids, position_ids=positions, prefix_keys=keys, use_cache=False)
    hidden = hidden.last_hidden_state
    targets = labels[:, 1:]
    keep = targets != IGNORE
    logits = head(hidden[:, :-1][keep]).float()
    per_token = nn.functional.cross_entropy(logits, targets[keep], reduction="none")
    row_of = torch.arange(len(examples), device=device)[:, None].expand_as(targets)[keep]
    sums = torch.zeros(len(examples), device=device, dtype=per_token.dtype)
    sums = sums.index_add(0, row_of, per_token)
    if not named:
        return sums, keep.sum(dim=1)
    wanted = torch.tensor([e.tool_tokens for e in examples], device=device)
    return sums, keep.sum(dim=1), tool_named(logits, targets, keep, wanted)


@dataclass
class StepLosses:
    """One step's micro-batch losses (mean over labelled tokens), in order; None where the loss
    was not finite (skipped, as the turn-by-turn trainer skips it)."""

    losses: list[float | None]


def shared_prefix_step(
    model, micro_batches: list[list[Example]], prefix: int, accum: int, pad_id: int,
    device: str, autocast, group_tokens: int = GROUP_TOKENS,
) -> StepLosses:  # fmt: skip
    """Forward and backward of one step's micro-batches whose turns share `prefix` tokens:
    gradients as turn-by-turn training's (each micro-batch's mean loss / accum), the prefix run
    once. A micro-batch whose loss is not finite adds nothing."""
    first = micro_batches[0][0].input_ids[:prefix]
    with autocast():
        computed = run_prefix(model, first, device, recompute=True)
    leaves = computed.detached()
    losses: list[float | None] = []
    for group in groups(micro_batches, prefix, group_tokens):
        turns = [e for batch in group for e in batch]
        with autocast():
            sums, counts = row_losses(model, turns, prefix, leaves, pad_id, device)
        total, at = None, 0
        for batch in group:
            s, n = sums[at : at + len(batch)].sum(), int(counts[at : at + len(batch)].sum())
            at += len(batch)
            loss = s / n if n else s * float("nan")
            if not torch.isfinite(loss):
                losses.append(None)
                continue
            losses.append(loss.item())
            total = loss / accum if total is None else total + loss / accum
        if total is not None:
            total.backward()
    tensors, grads = computed.gradients(leaves)
    if tensors:
        torch.autograd.backward(tensors, grads)
    return StepLosses(losses)


@torch.no_grad()
def shared_prefix_sums(
    model, examples: list[Example], prefix: int, pad_id: int, device: str, autocast,
    group_tokens: int = GROUP_TOKENS,
) -> tuple[list[float], list[int], list[bool]]:  # fmt: skip
    """Summed loss, labelled tokens and whether greedy decoding would name the recorded tool, of
    each example (forward only: validation), the prefix run once."""
    with autocast():
        keys = run_prefix(model, examples[0].input_ids[:prefix], device, recompute=False)
    sums, counts, named = [], [], []
    for group in groups([[e] for e in examples], prefix, group_tokens):
        turns = [batch[0] for batch in group]
        with autocast():
            s, n, right = row_losses(model, turns, prefix, keys, pad_id, device, named=True)
        sums += s.tolist()
        counts += n.tolist()
        named += right.tolist()
    return sums, counts, named
