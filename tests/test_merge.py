"""Joining shares' adapters: cat is the exact weighted average of the updates, svd reports its
residual, fedavg is the field's weight-for-weight average; mismatched adapters are refused."""

import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from gbray.merge import MergeError, merge_folders


def share(student, out, seed, r=4, alpha=8, targets=("q_proj", "v_proj"), rslora=False):
    """A LoRA adapter with random A and B (PEFT starts B at zero), saved as a folder."""
    torch.manual_seed(seed)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(student),
        LoraConfig(
            r=r,
            lora_alpha=alpha,
            target_modules=list(targets),
            use_rslora=rslora,
            task_type="CAUSAL_LM",
        ),
    )
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = torch.randn_like(p) * 0.1
    model.save_pretrained(out)
    (out / "trainer_state.json").write_text(json.dumps({"start": "bare"}))
    return out


def lora_tensors(folder):
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "adapter_model.safetensors"))
    config = json.loads((folder / "adapter_config.json").read_text())
    return tensors, config


def layers(tensors):
    return sorted(k.split(".lora_A.")[0] for k in tensors if ".lora_A." in k)


def written_out_average(folders, weights):
    """Σ w_i · (alpha_i / r_i) · B_i @ A_i by layer, computed here from the raw files."""
    total = sum(weights)
    out = {}
    for folder, w in zip(folders, weights, strict=True):
        tensors, config = lora_tensors(folder)
        scale = config["lora_alpha"] / config["r"]
        for layer in layers(tensors):
            a, b = tensors[f"{layer}.lora_A.weight"], tensors[f"{layer}.lora_B.weight"]
            out[layer] = out.get(layer, 0) + (w / total) * scale * (b @ a)
    return out


def deltas_as_peft_sees_them(student, folder):
    """The update PEFT itself applies when the merged folder is loaded."""
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(student), str(folder))
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "get_delta_weight") and "default" in getattr(module, "lora_A", {}):
            out[name] = module.get_delta_weight("default")
    return out


@pytest.fixture(scope="module")
def shares(raw_student, tmp_path_factory):
    root = tmp_path_factory.mktemp("shares")
    return [share(raw_student, root / f"s{i}", seed=i) for i in range(3)]


def relative(x, y):
    return float((x - y).norm() / y.norm())


def test_cat_is_the_exact_weighted_average_of_the_updates(raw_student, shares, tmp_path):
    turns = [300, 100, 50]  # shares sized by speed are unequal
    report = merge_folders(shares, tmp_path / "cat", "cat", turns=turns)
    assert report.exact and report.rank == 12
    expected = written_out_average(shares, turns)
    seen = deltas_as_peft_sees_them(raw_student, tmp_path / "cat")
    assert len(seen) == len(expected)
    for name, delta in seen.items():
        layer = next(k for k in expected if name.endswith(k.split("base_model.model.")[-1]))
        assert relative(delta, expected[layer]) < 1e-5, name
    assert report.residual_max < 1e-5


def test_svd_brings_it_back_to_rank_r_and_reports_its_residual(raw_student, shares, tmp_path):
    turns = [1, 1, 2]
    report = merge_folders(shares, tmp_path / "svd", "svd", turns=turns)
    assert report.method == "svd" and report.rank == 4 and not report.exact
    _, config = lora_tensors(tmp_path / "svd")
    assert config["r"] == 4
    expected = written_out_average(shares, turns)
    seen = deltas_as_peft_sees_them(raw_student, tmp_path / "svd")
    worst = 0.0
    for name, delta in seen.items():
        layer = next(k for k in expected if name.endswith(k.split("base_model.model.")[-1]))
        worst = max(worst, relative(delta, expected[layer]))
    # Three random rank-4 updates span rank 12: rank 4 leaves a real residual, reported as it is.
    assert report.residual_max > 0.05 and abs(worst - report.residual_max) < 1e-4


def test_fedavg_is_the_fields_weight_for_weight_average(shares, tmp_path):
    turns = [2, 1, 1]
    report = merge_folders(shares, tmp_path / "fedavg", "fedavg", turns=turns)
    assert report.method == "fedavg" and not report.exact and report.residual_max > 0.01
    merged, config = lora_tensors(tmp_path / "fedavg")
    assert config["r"] == 4 and config["lora_alpha"] == 8
    raw = [lora_tensors(s)[0] for s in shares]
    for key, value in merged.items():
        expected = sum(w / 4 * t[key] for w, t in zip(turns, raw, strict=True))
        assert torch.allclose(value, expected, atol=1e-7), key


def test_mismatched_adapters_are_refused(raw_student, shares, tmp_path):
    other_layers = share(raw_student, tmp_path / "attn", seed=9, targets=("q_proj", "k_proj"))
    with pytest.raises(MergeError, match="other layers"):
        merge_folders([shares[0], other_layers], tmp_path / "x")
    other_start = share(raw_student, tmp_path / "carried", seed=10)
    (other_start / "trainer_state.json").write_text(json.dumps({"start": "hub:r1"}))
    with pytest.raises(MergeError, match="one start"):
        merge_folders([shares[0], other_start], tmp_path / "y")
    other_rank = share(raw_student, tmp_path / "r8", seed=11, r=8, alpha=16)
    with pytest.raises(MergeError, match="one rank"):
        merge_folders([shares[0], other_rank], tmp_path / "z", "fedavg")
    with pytest.raises(MergeError, match="two adapters"):
        merge_folders([shares[0]], tmp_path / "w")


def test_chained_merges_do_not_grow_the_rank_without_bound(shares, tmp_path):
    first = merge_folders(shares, tmp_path / "n1", "cat", max_rank=16)
    assert first.rank == 12
    # The next night's shares carry on from the merge (rank 12 each); cat would give 36.
    again = merge_folders(
        [tmp_path / "n1", tmp_path / "n1", tmp_path / "n1"], tmp_path / "n2", "cat", max_rank=16
    )
    assert again.rank == 16 and again.method == "svd"


def test_gbray_merge_on_the_command_line(shares, raw_student, tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "gbray.cli", "merge", str(shares[0]), str(shares[1]),
         "--method", "svd", "--turns", "3", "1", "--out", str(tmp_path / "m")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["method"] == "svd" and report["weights"] == [0.75, 0.25] and report["rank"] == 4
    assert (tmp_path / "m" / "merge.json").is_file()
    other = share(raw_student, tmp_path / "attn", seed=9, targets=("q_proj", "k_proj"))
    refused = subprocess.run(
        [sys.executable, "-m", "gbray.cli", "merge", str(shares[0]), str(other), "--out", str(tmp_path / "x")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode == 2
    errors = [line for line in refused.stderr.splitlines() if line.startswith("gbray: error:")]
    assert len(errors) == 1 and "other layers" in errors[0]
