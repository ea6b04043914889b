import math

import pytest
import torch
from torch import nn

from gbray.data.fit import collate, make_example
from gbray.model import answer_loss, load_student, lora_targets, wrap_lora


class ClippableLinear(nn.Module):
    """Like Gemma 4's: a wrapper whose only Linear child does the work."""

    def __init__(self, n):
        super().__init__()
        self.linear = nn.Linear(n, n)
        self.clip = 1.0

    def forward(self, x):
        return self.linear(x).clamp(-self.clip, self.clip)


class Attention(nn.Module):
    def __init__(self, n, wrapped=False):
        super().__init__()
        self.q_proj = ClippableLinear(n) if wrapped else nn.Linear(n, n)
        self.v_proj = nn.Linear(n, n)
        self.other = nn.Linear(n, n)


class Multimodal(nn.Module):
    def __init__(self):
        super().__init__()
        self.language_model = nn.ModuleList([Attention(8, wrapped=True), Attention(8)])
        self.vision_tower = nn.ModuleList([Attention(8)])
        self.audio_encoder = Attention(8)


def test_lora_targets_wrapped_linear_and_towers():
    targets = lora_targets(Multimodal(), ("q_proj", "v_proj"))
    assert targets == [
        "language_model.0.q_proj.linear",
        "language_model.0.v_proj",
        "language_model.1.q_proj",
        "language_model.1.v_proj",
    ]


def test_lora_on_the_wrapped_model_trains_only_adapters():
    from peft import LoraConfig, get_peft_model

    model = Multimodal()
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=lora_targets(model, ("q_proj",))))
    trainable = [n for n, p in peft.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not any("vision" in n or "audio" in n for n in trainable)


@pytest.fixture(scope="module")
def lora_student(raw_student):
    model, tokenizer = load_student(
        raw_student,
        None,
        "float32",
        trainable=True,
        lora={"scope": "all", "r": 4, "alpha": 8, "dropout": 0.0},
    )
    # A fresh LoRA is a no-op (B = 0); perturb it so the comparison covers the adapter path.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model.eval(), tokenizer


def test_head_only_loss_equals_the_models_own_loss(lora_student):
    model, tokenizer = lora_student
    turns = [
        {
            "system": "Tools: open, read",
            "user": f"page {i} " * (5 + 7 * i),
            "answer": '{"tool":"open","args":{"n":' + str(i) + "}}",
            "tool": "open",
        }
        for i in range(3)
    ]
    batch = collate([make_example(tokenizer, t, 256, 32) for t in turns], tokenizer.pad_token_id)
    with torch.no_grad():
        ours, count = answer_loss(model, batch)
        theirs = model(**batch).loss
    assert count == int((batch["labels"][:, 1:] != -100).sum())
    assert math.isclose(ours.item(), theirs.item(), rel_tol=0, abs_tol=1e-5)


def test_wrap_lora_refuses_a_model_without_targets():
    with pytest.raises(ValueError, match="no LoRA targets"):
        wrap_lora(nn.Sequential(nn.Linear(2, 2)), "all", 2, 4, 0.0)
