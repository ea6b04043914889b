import json
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


# LoRA's input dropout, folded into the A matrix (gbray.model.DropoutLinear)


def _small_qwen(dropout: float, fold: bool = True):
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300,
    )  # fmt: skip
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(config)
    if fold:
        model = wrap_lora(base, "all", 8, 16, dropout)
    else:  # PEFT as it comes, its own dropout modules
        targets = lora_targets(
            base, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        )
        lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules=targets)
        model = get_peft_model(base, lora)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at zero, where dropout could not change any output
            torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(len(name)))
    return model.train()


def _grads(model, ids, seed: int) -> dict:
    model.zero_grad()
    torch.manual_seed(seed)
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_folded_dropout_is_dropout_with_a_mask_it_can_draw_again():
    from gbray.model import _DropoutThenLinear, _kept

    x = torch.randn(2, 50, 64, requires_grad=True)
    w = torch.randn(8, 64, requires_grad=True)
    g = torch.randn(2, 50, 8)
    (_DropoutThenLinear.apply(x, w, 0.3, 1234, torch.float32) * g).sum().backward()
    folded = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    keep, scale = _kept(x.detach(), 0.3, 1234)
    assert 0.27 < 1 - keep.float().mean() < 0.33 and scale == pytest.approx(1 / 0.7, rel=1e-4)
    assert torch.equal(keep, _kept(x.detach(), 0.3, 1234)[0])
    assert not torch.equal(keep, _kept(x.detach(), 0.3, 1235)[0])
    (nn.functional.linear(x * keep * scale, w) * g).sum().backward()
    assert torch.allclose(folded[0], x.grad, atol=1e-6)
    assert torch.allclose(folded[1], w.grad, atol=1e-5)


def test_the_folded_dropout_keeps_no_more_for_backward_than_no_dropout():
    from gbray.tuning import SavedForBackward

    ids = torch.randint(0, 300, (1, 128))
    saved = {}
    for name, dropout, fold in (("peft", 0.05, False), ("folded", 0.05, True), ("none", 0.0, True)):
        model = _small_qwen(dropout, fold)
        with SavedForBackward(model) as measure:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        saved[name] = measure.bytes
    assert saved["folded"] == saved["none"]
    assert saved["peft"] > 1.3 * saved["folded"], saved


def test_the_folded_dropout_drops_in_training_only_and_saves_peft_files(tmp_path):
    from peft import get_peft_model_state_dict

    ids = torch.randint(0, 300, (1, 64))
    folded, plain = _small_qwen(0.2), _small_qwen(0.2, fold=False)
    assert get_peft_model_state_dict(folded).keys() == get_peft_model_state_dict(plain).keys()
    assert not any(isinstance(m, nn.Dropout) for m in folded.modules())
    torch.manual_seed(1)
    first = folded(input_ids=ids).logits
    second = folded(input_ids=ids).logits
    assert not torch.allclose(first, second)  # two draws of the mask
    folded.eval(), plain.eval()
    with torch.no_grad():
        assert torch.allclose(folded(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-6)
    folded.save_pretrained(tmp_path)
    from peft import PeftModel
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    base = Qwen2ForCausalLM(folded.get_base_model().config)
    loaded = PeftModel.from_pretrained(base, str(tmp_path)).eval()
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-6)


def test_checkpointing_draws_the_same_folded_masks_again():
    ids = torch.randint(0, 300, (1, 64))
    model = _small_qwen(0.3)
    plain = _grads(model, ids, seed=5)
    other_draw = _grads(model, ids, seed=6)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    checkpointed = _grads(model, ids, seed=5)
    assert plain.keys() == checkpointed.keys() and plain
    assert all(torch.allclose(plain[n], checkpointed[n], atol=1e-6) for n in plain)
    assert not all(torch.allclose(plain[n], other_draw[n], atol=1e-6) for n in plain)


def test_the_folded_dropout_computes_in_autocasts_dtype():
    model = _small_qwen(0.1)
    ids = torch.randint(0, 300, (1, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    a = next(m for m in model.modules() if type(m).__name__ == "DropoutLinear")
    assert a.weight.grad is not None and a.weight.grad.dtype == torch.float32
    assert torch.isfinite(a.weight.grad).all() and a.weight.grad.abs().sum() > 0


def test_a_tiny_student_is_pretrained_a_set_number_of_steps_and_is_the_same_each_time(
    corpus, tmp_path
):
    """Counted in steps, not seconds: two builds (one on one thread, one on two) are the same
    student, whatever else the machine is doing."""
    from safetensors.torch import load_file

    from gbray.student import StudentSettings, build_student

    records, weights = [], []
    for threads in (1, 2):
        out = tmp_path / f"s{threads}"
        settings = StudentSettings(
            data=corpus, out=out, vocab=600, pretrain_steps=3, threads=threads
        )
        records.append(build_student(settings))
        weights.append(load_file(out / "model.safetensors"))
    assert [r["pretraining"]["steps"] for r in records] == [3, 3]
    assert StudentSettings(data=corpus, out=tmp_path).pretrain_steps == 450
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.allclose(weights[0][k], weights[1][k], atol=1e-4) for k in weights[0])
    with pytest.raises(ValueError, match="--pretrain-steps"):
        StudentSettings(data=corpus, out=tmp_path, pretrain_steps=-1).validate()


def test_a_kept_student_is_handed_out_only_for_the_same_settings_and_corpus(corpus, tmp_path):
    """The student cache: a second build of the same settings on the same corpus is a copy of
    the first (no pre-training); another setting, another corpus or a student pre-trained by the
    clock is built anew."""
    import shutil

    from gbray.student import StudentSettings, build_student_kept, student_key

    cache = tmp_path / "cache"

    def build(name, data=corpus, **kw):
        settings = StudentSettings(
            data=data, out=tmp_path / name, vocab=600, pretrain_steps=2, **kw
        )
        return build_student_kept(settings, cache), settings

    (first, kept), settings = build("a")
    assert kept is None and first["pretraining"]["steps"] == 2
    (again, kept), _ = build("b", threads=1)  # threads are not part of what a student is
    assert kept == cache / "students" / student_key(settings)
    assert (tmp_path / "b" / "model.safetensors").read_bytes() == (
        tmp_path / "a" / "model.safetensors"
    ).read_bytes()
    assert json.loads((tmp_path / "b" / "student.json").read_text())["settings"]["out"] == str(
        tmp_path / "b"
    )
    assert build("c", seed=1)[0][1] is None
    other = tmp_path / "other"
    shutil.copytree(corpus, other)
    with open(other / "train.jsonl", "rb+") as f:
        lines = f.readlines()[:-1]
        f.seek(0)
        f.truncate()
        f.writelines(lines)
    assert build("d", data=other)[0][1] is None
    (timed, kept), timed_settings = build("e", pretrain_seconds=0.5)
    assert kept is None and student_key(timed_settings) is None
    assert build("f")[0][1] is not None
    assert build_student_kept(settings, cache, fresh=True)[1] is None
