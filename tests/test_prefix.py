"""A step's turns run their shared prompt prefix once: the same losses and gradients as running
every turn whole, with fewer tokens."""

import pytest
import torch

from gbray.data.fit import IGNORE, make_example
from gbray.data.turns import index_folder
from gbray.prefix import _PrefixAndOwn, common_prefix, groups, saving
from gbray.settings import Recipe
from gbray.trainer import Trainer, TrainState
from gbray.tuning import choose


def recipe(**kw):
    base = dict(
        hours=1.0, epochs=1, lr=1e-3, batch=1, accum=4, lora_r=4, lora_alpha=8, max_len=256,
        answer_room=32, val_turns=4, val_every_minutes=0, val_every_steps=0, seed=1,
        device="cpu", threads=1, exam_turns=10, turns=12, lora_dropout=0.0,
        precision="float32", gradient_checkpointing=False,
    )  # fmt: skip
    base.update(kw)
    return Recipe(**base)


@pytest.fixture(scope="module")
def turns(corpus):
    train, _ = index_folder(corpus)
    return train.read(list(range(16)))


@pytest.mark.parametrize("rows,heads,length,prefix", [(3, 4, 6, 9), (1, 2, 5, 1), (4, 2, 1, 7)])
def test_prefix_attention_is_attention_over_the_prefix_and_the_rows_own_keys(
    rows, heads, length, prefix
):
    torch.manual_seed(0)
    dim = 8
    q = torch.randn(rows, heads, length, dim, requires_grad=True)
    pk, pv = (torch.randn(1, heads, prefix, dim, requires_grad=True) for _ in range(2))
    k, v = (torch.randn(rows, heads, length, dim, requires_grad=True) for _ in range(2))
    out = _PrefixAndOwn.apply(q, pk, pv, k, v, dim**-0.5)
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, pk, pv, k, v), upstream)
    # The reference: each row's keys whole (the prefix copied in), under the causal mask.
    keys = torch.cat([pk.expand(rows, -1, -1, -1), k], 2)
    values = torch.cat([pv.expand(rows, -1, -1, -1), v], 2)
    mask = torch.ones(length, prefix + length, dtype=torch.bool)
    mask[:, prefix:] = torch.ones(length, length, dtype=torch.bool).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    ref_grads = torch.autograd.grad(ref, (q, pk, pv, k, v), upstream)
    assert torch.allclose(out, ref, atol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        assert torch.allclose(got, want, atol=1e-5)


def _train_steps(student, turns, out, windows, **kw):
    """Run `windows` optimizer steps of accum micro-batches: the trainer, its state, and the
    adapter's gradients of the first step."""
    trainer = Trainer(str(student), None, recipe(**kw), out)
    r = trainer.recipe
    examples = [make_example(trainer.tokenizer, t, r.max_len, r.answer_room) for t in turns]
    state = TrainState()
    size = r.batch * r.accum
    first = {}
    for w in range(windows):
        window = examples[w * size : (w + 1) * size]
        batches = [window[i : i + r.batch] for i in range(0, len(window), r.batch)]
        trainer.accumulate(batches, state)
        if not first:
            lora = trainer.model.named_parameters()
            first = {n: p.grad.clone() for n, p in lora if "lora_" in n}
        trainer.optimizer_step(state, r.lr)
    return trainer, state, first


@pytest.mark.parametrize("batch,checkpointing", [(1, False), (2, False), (1, True)])
def test_sharing_the_prefix_learns_what_turn_by_turn_training_learns(
    raw_student, turns, tmp_path, batch, checkpointing
):
    kw = dict(batch=batch, gradient_checkpointing=checkpointing)
    steps = 3 if batch == 1 else 2  # 12 or 16 turns
    t_on, on, g_on = _train_steps(raw_student, turns, tmp_path / "on", steps, **kw)
    _, off, g_off = _train_steps(
        raw_student, turns, tmp_path / "off", steps, share_prefix=False, **kw
    )
    assert t_on.choices.share_prefix and on.shared_steps == steps and off.shared_steps == 0
    assert on.spared > 0 and off.spared == 0
    # Every micro-batch's loss, over three optimizer steps, to 1e-5.
    assert len(on.losses) == len(off.losses) == steps * 4
    assert on.losses == pytest.approx(off.losses, abs=1e-5)
    # The first step's gradients, relative to the largest (B's gradients start non-zero).
    scale = max(g.abs().max() for g in g_off.values())
    assert scale > 0
    for name, grad in g_off.items():
        assert (g_on[name] - grad).abs().max() <= 1e-5 * scale, name


def test_an_adapter_on_some_projections_only_learns_the_same(raw_student, turns, tmp_path):
    """Carried on from an adapter on q and v only: the first layer's prefix keys reach no
    adapter (they need no gradient), its values do."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    start = tmp_path / "start"
    get_peft_model(
        AutoModelForCausalLM.from_pretrained(raw_student),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    ).save_pretrained(start)
    found = {}
    for share in (True, False):
        trainer = Trainer(
            str(raw_student), str(start), recipe(share_prefix=share), tmp_path / str(share)
        )
        r = trainer.recipe
        window = [[make_example(trainer.tokenizer, t, r.max_len, r.answer_room)] for t in turns[:4]]
        state = TrainState()
        trainer.accumulate(window, state)
        assert state.shared_pending == share
        found[share] = (state.losses, {
            n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad
        })  # fmt: skip
    assert found[True][0] == pytest.approx(found[False][0], abs=1e-5)
    scale = max(g.abs().max() for g in found[False][1].values())
    for name, grad in found[False][1].items():
        assert (found[True][1][name] - grad).abs().max() <= 1e-5 * scale, name


def test_validation_with_the_prefix_shared_gives_the_same_loss(raw_student, turns, tmp_path):
    shared = Trainer(str(raw_student), None, recipe(), tmp_path / "a")
    whole = Trainer(str(raw_student), None, recipe(share_prefix=False), tmp_path / "b")
    r = shared.recipe
    val = [make_example(shared.tokenizer, t, r.max_len, r.answer_room) for t in turns[:8]]
    assert common_prefix(val) > 0 and saving([val], common_prefix(val)) > 0.1
    assert shared.validation_loss(val) == pytest.approx(whole.validation_loss(val), abs=1e-5)


def test_a_non_finite_turn_in_a_shared_step_is_skipped_and_counted(raw_student, turns, tmp_path):
    trainer = Trainer(str(raw_student), None, recipe(), tmp_path)
    r = trainer.recipe
    window = [[make_example(trainer.tokenizer, t, r.max_len, r.answer_room)] for t in turns[:4]]
    window[1][0].labels = [IGNORE] * len(window[1][0].labels)  # nothing labelled: 0/0
    state = TrainState()
    trainer.accumulate(window, state)
    assert state.shared_pending and state.skipped_nan == 1
    assert state.micro == 4 and state.pending == 3 and len(state.losses) == 3
    trainer.optimizer_step(state, r.lr)
    lora = [p for n, p in trainer.model.named_parameters() if "lora_" in n]
    assert all(torch.isfinite(p).all() for p in lora)
    assert any(p.abs().sum() > 0 for n, p in trainer.model.named_parameters() if "lora_B" in n)


def test_turns_that_share_too_little_are_trained_whole(raw_student, turns, tmp_path):
    trainer = Trainer(str(raw_student), None, recipe(), tmp_path)
    r = trainer.recipe
    window = [[make_example(trainer.tokenizer, t, r.max_len, r.answer_room)] for t in turns[:4]]
    for i, batch in enumerate(window):  # a first token of its own: nothing shared
        batch[0].input_ids = [i + 5, *batch[0].input_ids[1:]]
    assert common_prefix([b[0] for b in window]) == 0
    state = TrainState()
    trainer.accumulate(window, state)
    assert not state.shared_pending and state.micro == 4 and len(state.losses) == 4


def test_a_round_records_the_shared_prefix(raw_student, turns, tmp_path):
    lines = []
    trainer = Trainer(str(raw_student), None, recipe(), tmp_path, report=lines.append)
    summary = trainer.train(turns[:12], turns[12:])
    assert summary.choices["share_prefix"] is True
    assert any(x.startswith("the slice's turns all begin with the same") for x in lines), lines
    assert summary.shared_prefix_steps == 3
    assert 0.3 < summary.spared_tokens_share < 1


def test_the_sharing_choice_says_why():
    def step_on(tokens, autocast, checkpointing):
        return tokens * 1000

    on = choose(recipe(), 2, "cpu", step_on, longest=100)
    assert on.share_prefix and "shared prefix on" in on.line()
    off = choose(recipe(share_prefix=False), 2, "cpu", step_on, longest=100)
    assert not off.share_prefix and off.why_share_prefix == "asked (--no-share-prefix)"
    other = choose(recipe(), 2, "cpu", step_on, longest=100, prefix_attention=False)
    assert not other.share_prefix and "exactly" in other.why_share_prefix
    gpu = choose(recipe(), 2, "cuda", step_on, longest=100)
    assert not gpu.share_prefix


def test_groups_keep_micro_batches_whole_under_the_token_budget():
    from gbray.data.fit import Example

    def ex(n):
        return Example(list(range(n)), [IGNORE] * (n - 1) + [1], "t", False)

    batches = [[ex(110), ex(110)], [ex(60)], [ex(300)], [ex(20)]]  # rows of 100+100, 50, 290, 10
    assert [len(g) for g in groups(batches, prefix=10, budget=249)] == [1, 1, 1, 1]
    assert groups(batches, prefix=10, budget=250) == [batches[:2], batches[2:3], batches[3:]]
