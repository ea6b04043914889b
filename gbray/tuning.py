"""How the trainer configures itself on the machine it finds, from measurement.

- Threads: the CPUs its actor holds (oversubscribed threads are catastrophic), or one thread
  where a probe shows one faster (cores busy with work outside Ray: beside a busy loop on one of
  two cores, a tiny student's step took 0.53 s on two threads and 0.26 s on one).
- bfloat16 autocast (float32 weights, bfloat16 compute) only where the CPU has native bfloat16
  (AMX or AVX512-BF16) and a short probe of forward and backward shows it faster; on a GPU only
  when asked (SPEC §5). Without native support bfloat16 was reported 44x slower than float32.
- Gradient checkpointing only when the memory measured free would not hold the activations of
  the longest turn (what a probe turn keeps per token, from probes of two lengths): its ~25%
  recompute is the price of memory, not a law.
- A shared prefix (gbray.prefix): the prompt prefix a step's turns share runs once a step, on a
  CPU, for the architectures whose attention gbray.prefix computes exactly; each step uses it
  where it spares a tenth of the step's tokens.

Each choice can be forced by its setting (`--precision`, `--gradient-checkpointing`,
`--threads`, `--no-share-prefix`); all are printed at start and stored with the round's recipe.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import psutil
import torch

log = logging.getLogger(__name__)

PROBE_TOKENS = 256
# Activations may use at most this share of the memory free when training starts.
MEMORY_SHARE = 0.6


@dataclass(frozen=True)
class Choices:
    """What the trainer runs with, and why each was chosen."""

    threads: int
    autocast: bool
    checkpointing: bool
    why_precision: str
    why_checkpointing: str
    why_threads: str
    share_prefix: bool
    why_share_prefix: str

    def line(self) -> str:
        precision = "bfloat16 autocast" if self.autocast else "float32"
        return (
            f"configured: {precision} ({self.why_precision}); checkpointing "
            f"{'on' if self.checkpointing else 'off'} ({self.why_checkpointing}); "
            f"{self.threads} threads ({self.why_threads}); shared prefix "
            f"{'on' if self.share_prefix else 'off'} ({self.why_share_prefix})"
        )

    def as_dict(self) -> dict:
        return asdict(self)


def native_bfloat16() -> tuple[bool, str]:
    """Whether this CPU computes bfloat16 natively, and what it has."""
    if torch.cpu._is_amx_tile_supported():
        return True, "the CPU has AMX"
    if torch.cpu._is_avx512_bf16_supported():
        return True, "the CPU has AVX512-BF16"
    return False, f"the CPU has no native bfloat16 ({torch.backends.cpu.get_cpu_capability()})"


def autocast(device: str, on: bool):
    return torch.autocast(device_type=device, dtype=torch.bfloat16) if on else nullcontext()


class SavedForBackward:
    """Bytes the forward pass keeps for backward (the activations), parameters left out:
    measured exactly through autograd's saved-tensor hooks, where a process's resident size
    would also count the allocator's caching."""

    def __init__(self, model: torch.nn.Module):
        self.params = {p.data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}

    def _pack(self, tensor):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in self.params:
            self.storages[ptr] = tensor.untyped_storage().nbytes()
        return tensor

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def free_memory(device: str) -> int:
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    return psutil.virtual_memory().available


def _seconds(step: Callable[[], None], repeats: int = 2) -> float:
    step()  # warm-up: first calls pay for kernel selection and allocation
    started = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - started) / repeats


def choose(
    recipe,
    threads: int,
    device: str,
    step_on: Callable[[int, bool, bool], None],
    longest: int,
    native: Callable[[], tuple[bool, str]] = native_bfloat16,
    prefix_attention: bool = True,
) -> Choices:
    """The trainer's choices for this machine. `step_on(tokens, autocast, checkpointing)` runs one
    forward and backward on a probe turn of that many tokens (its gradients thrown away) and
    returns the bytes its forward saved for backward; `longest` is the longest training turn in
    tokens times the batch; `prefix_attention`, whether the model runs gbray's shared-prefix
    attention."""
    probe = max(16, min(PROBE_TOKENS, longest))
    threads, why_threads = _choose_threads(recipe, device, step_on, probe, threads)
    autocast_on, why_precision = _choose_precision(recipe, device, step_on, probe, native)
    checkpointing, why_ckpt = _choose_checkpointing(
        recipe, device, step_on, probe, longest, autocast_on
    )
    share, why_share = _choose_sharing(recipe, device, prefix_attention)
    return Choices(
        threads, autocast_on, checkpointing, why_precision, why_ckpt, why_threads, share, why_share
    )


def _choose_sharing(recipe, device, prefix_attention: bool) -> tuple[bool, str]:
    """Whether a step's turns run their shared prompt prefix once (gbray.prefix): the same
    gradients from fewer tokens, so on wherever it can run."""
    if recipe.share_prefix is False:
        return False, "asked (--no-share-prefix)"
    if device != "cpu":
        return False, "its attention uses PyTorch's CPU flash kernels"
    if not prefix_attention:
        return False, "the model's attention is not one it computes exactly (gbray.prefix)"
    return True, "a step's turns run the prompt prefix they share once, where that spares a tenth"


# One thread must beat the actor's CPUs by this much to be chosen: a probe is a noisy clock.
ONE_THREAD_MARGIN = 1.2


def _choose_threads(recipe, device, step_on, probe, threads) -> tuple[int, str]:
    """The actor's CPUs, unless one thread runs the probe faster: leaves torch at the choice."""
    probe_asked = recipe.thread_probe
    if probe_asked is False or (probe_asked is None and recipe.threads > 0):
        return threads, "fixed by the recipe (--threads or --no-thread-probe)"
    if device == "cuda" or threads == 1:
        return threads, "the CPUs the actor holds"
    torch.set_num_threads(threads)
    many = _seconds(lambda: step_on(probe, False, False))
    torch.set_num_threads(1)
    one = _seconds(lambda: step_on(probe, False, False))
    if one * ONE_THREAD_MARGIN < many:
        return 1, (
            f"a {probe}-token probe ran {many / one:.1f}x faster on 1 thread than on {threads}: "
            "the CPUs are busy with other work"
        )
    torch.set_num_threads(threads)
    return threads, "the CPUs the actor holds"


def _choose_precision(recipe, device, step_on, probe, native) -> tuple[bool, str]:
    if recipe.precision == "autocast":
        return True, "asked (--precision autocast)"
    if recipe.precision in ("float32", "bfloat16"):
        return False, f"asked (--precision {recipe.precision})"
    if device == "cuda":
        return False, "float32 on a GPU unless asked (SPEC §5)"
    has, what = native()
    if not has:
        return False, what
    plain = _seconds(lambda: step_on(probe, False, False))
    mixed = _seconds(lambda: step_on(probe, True, False))
    if mixed < plain:
        return True, f"{what}; a {probe}-token probe ran {plain / mixed:.1f}x faster in it"
    return False, f"{what}, but a {probe}-token probe ran {mixed / plain:.1f}x slower in it"


def _choose_checkpointing(recipe, device, step_on, probe, longest, autocast_on) -> tuple[bool, str]:
    if recipe.gradient_checkpointing is not None:
        flag = (
            "--gradient-checkpointing"
            if recipe.gradient_checkpointing
            else "--no-gradient-checkpointing"
        )
        return recipe.gradient_checkpointing, f"asked ({flag})"
    saved = step_on(probe, autocast_on, False)
    # What grows with the tokens, from a probe of half the length: the rest does not (under
    # autocast, the bfloat16 copies of the weights: 0.7 GB on the 0.5B shape, which scaled with
    # the tokens read as 9 GB more than a 2,112-token turn holds). Attention through SDPA keeps
    # no score matrix. Half again for what a step holds briefly (logits, gradients in flight).
    per_token = max(0.0, (saved - step_on(probe // 2, autocast_on, False)) / (probe - probe // 2))
    need = 1.5 * (saved + per_token * max(0, longest - probe))
    free = free_memory(device)
    gb = 1024**3
    if need <= MEMORY_SHARE * free:
        return (
            False,
            f"the longest turn needs about {need / gb:.1f} GB of the {free / gb:.1f} GB free",
        )
    return True, (
        f"the longest turn would need about {need / gb:.1f} GB of activations; "
        f"{free / gb:.1f} GB free"
    )
