"""Joining the adapters of several shares into one (SPEC §9). Knows nothing of Ray: torch and the
PEFT adapter format only (a folder with adapter_config.json and adapter_model.safetensors).

Each share i adapts a linear layer by ΔW_i = s_i · B_i · A_i (s = lora_alpha / r, or
lora_alpha / √r with rsLoRA). Shares are weighted by the turns they trained, w_i summing to one.

- `cat`: the exact weighted average Σ w_i ΔW_i, at rank Σ r_i: A = [w_i s_i A_i] stacked, B =
  [B_i] side by side, scaling 1. Past `max_rank` it is brought down with the SVD (the residual
  is reported), so nights that carry on from a merge never grow the rank without bound.
- `svd`: the same exact average brought back to rank r with a truncated SVD; the relative
  residual ‖ΔW − B·A‖ / ‖ΔW‖ of every layer is reported.
- `fedavg`: A and B averaged weight for weight, as the field's devices do; not the average of
  the updates (Σ w B_i · Σ w A_i has cross terms), reported as inexact with its relative error.

PEFT's own `add_weighted_adapter` does cat and svd too, but on a loaded base model; these work on
the adapter files alone, and its `linear` is not the field's fedavg (weights [0.5, 0.5] double an
update shared by both).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

METHODS = ("cat", "svd", "fedavg")
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


class MergeError(ValueError):
    """Adapters that cannot be joined, with a one-line reason."""


@dataclass
class Adapter:
    """One adapter as files: its config, its LoRA pairs by layer, and what gbray knows of its start."""

    path: Path
    config: dict
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer -> (A: r x in, B: out x r)
    start: str | None = None

    @property
    def scaling(self) -> float:
        r, alpha = self.config["r"], self.config["lora_alpha"]
        return alpha / math.sqrt(r) if self.config.get("use_rslora") else alpha / r

    @classmethod
    def load(cls, path: Path) -> Adapter:
        path = Path(path)
        try:
            config = json.loads((path / CONFIG_FILE).read_text())
            tensors = load_file(str(path / WEIGHTS_FILE))
        except (OSError, ValueError) as e:
            raise MergeError(f"{path} is not a PEFT adapter folder: {e}") from e
        if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
            raise MergeError(f"{path}: only plain LoRA adapters are merged")
        if config.get("rank_pattern") or config.get("alpha_pattern"):
            raise MergeError(f"{path}: per-layer ranks or alphas are not merged")
        pairs = {}
        for key, a in tensors.items():
            if ".lora_A." in key:
                layer = key.split(".lora_A.")[0]
                b = tensors.get(key.replace(".lora_A.", ".lora_B."))
                if b is None:
                    raise MergeError(f"{path}: {layer} has lora_A without lora_B")
                pairs[layer] = (a.float(), b.float())
        if not pairs:
            raise MergeError(f"{path}: no LoRA layers")
        state = path / "trainer_state.json"
        start = json.loads(state.read_text()).get("start") if state.is_file() else None
        return cls(path, config, pairs, start)

    def delta(self, layer: str) -> torch.Tensor:
        a, b = self.pairs[layer]
        return self.scaling * (b @ a)


@dataclass
class MergeReport:
    method: str
    shares: list[str]
    weights: list[float]
    rank: int
    exact: bool
    # Relative Frobenius error of the merged update against the exact weighted average, by layer.
    residual_max: float = 0.0
    residual_mean: float = 0.0
    residual_by_layer: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def check_joinable(adapters: list[Adapter]) -> None:
    """One start and one shape, or a one-line reason."""
    if len(adapters) < 2:
        raise MergeError("a merge needs two adapters or more")
    first = adapters[0]
    for other in adapters[1:]:
        base = (
            first.config.get("base_model_name_or_path"),
            other.config.get("base_model_name_or_path"),
        )
        if base[0] != base[1]:
            raise MergeError(f"{other.path} was trained on {base[1]}, {first.path} on {base[0]}")
        if first.start and other.start and first.start != other.start:
            raise MergeError(
                f"{other.path} started from {other.start}, {first.path} from {first.start}: "
                "shares must train from one start"
            )
        if set(first.pairs) != set(other.pairs):
            raise MergeError(f"{other.path} adapts other layers than {first.path}")
        for layer, (a, b) in first.pairs.items():
            oa, ob = other.pairs[layer]
            if a.shape[1] != oa.shape[1] or b.shape[0] != ob.shape[0]:
                raise MergeError(f"{other.path}: {layer} has another shape than in {first.path}")


def weights_of(adapters: list[Adapter], turns: list[float] | None) -> list[float]:
    turns = turns or [1.0] * len(adapters)
    if len(turns) != len(adapters) or any(not math.isfinite(t) or t < 0 for t in turns):
        raise MergeError("one non-negative weight (turns trained) per adapter")
    total = sum(turns)
    if total <= 0:
        raise MergeError("the shares trained no turns between them")
    return [t / total for t in turns]


def _truncate(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """B (out x k), A (k x in) with B·A the best rank-k approximation of delta, and the residual."""
    u, s, vh = torch.linalg.svd(delta.double(), full_matrices=False)
    k = min(rank, s.numel())
    root = s[:k].sqrt()
    b, a = (u[:, :k] * root), (root[:, None] * vh[:k])
    norm = delta.double().norm()
    residual = float((delta.double() - b @ a).norm() / norm) if norm > 0 else 0.0
    return b.float(), a.float(), residual


def merge(
    adapters: list[Adapter],
    method: str = "cat",
    turns: list[float] | None = None,
    max_rank: int = 256,
) -> tuple[dict[str, torch.Tensor], dict, MergeReport]:
    """The merged LoRA tensors (PEFT key names), its config and the report."""
    if method not in METHODS:
        raise MergeError(f"method {method!r}: one of {', '.join(METHODS)}")
    check_joinable(adapters)
    w = weights_of(adapters, turns)
    first = adapters[0]
    ranks = [ad.config["r"] for ad in adapters]
    if method == "fedavg" and len(set(ranks)) > 1:
        raise MergeError(f"fedavg needs one rank, these have {sorted(set(ranks))}")
    rank = {"cat": sum(ranks), "svd": max(ranks), "fedavg": ranks[0]}[method]
    if method == "cat" and rank > max_rank:
        method, rank = "svd", max_rank
    tensors, residuals = {}, {}
    for layer in first.pairs:
        exact = sum(wi * ad.delta(layer) for wi, ad in zip(w, adapters, strict=True))
        if method == "cat":
            a = torch.cat(
                [wi * ad.scaling * ad.pairs[layer][0] for wi, ad in zip(w, adapters, strict=True)]
            )
            b = torch.cat([ad.pairs[layer][1] for ad in adapters], dim=1)
            scaling = 1.0
        elif method == "svd":
            b, a, _ = _truncate(exact, rank)
            scaling = 1.0
        else:
            a = sum(wi * ad.pairs[layer][0] for wi, ad in zip(w, adapters, strict=True))
            b = sum(wi * ad.pairs[layer][1] for wi, ad in zip(w, adapters, strict=True))
            scaling = first.scaling
        norm = exact.norm()
        residuals[layer] = float((exact - scaling * (b @ a)).norm() / norm) if norm > 0 else 0.0
        tensors[f"{layer}.lora_A.weight"] = a.contiguous()
        tensors[f"{layer}.lora_B.weight"] = b.contiguous()
    config = {**first.config, "r": rank}
    if method != "fedavg":
        # Scaling 1: the factors carry the whole update.
        config.update(lora_alpha=math.sqrt(rank) if first.config.get("use_rslora") else rank)
    values = list(residuals.values())
    report = MergeReport(
        method=method,
        shares=[str(ad.path) for ad in adapters],
        weights=[round(x, 6) for x in w],
        rank=rank,
        exact=method == "cat",
        residual_max=max(values),
        residual_mean=sum(values) / len(values),
        residual_by_layer={k: round(v, 8) for k, v in residuals.items()},
    )
    return tensors, config, report


def merge_folders(
    folders: list[Path],
    out: Path,
    method: str = "cat",
    turns: list[float] | None = None,
    max_rank: int = 256,
) -> MergeReport:
    """Merge adapter folders into `out`, a PEFT adapter folder with merge.json beside its files."""
    adapters = [Adapter.load(Path(f)) for f in folders]
    tensors, config, report = merge(adapters, method, turns, max_rank)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    start = adapters[0].start
    (out / "trainer_state.json").write_text(json.dumps({"start": start, "merged": report.method}))
    (out / "merge.json").write_text(json.dumps(report.as_dict(), indent=2))
    return report
