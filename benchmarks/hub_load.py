"""The hub under load: 5 devices sending notes at 50 a second in all, first alone (the baseline),
then while 8 adapters of 40 MB land in 16 MB pieces. Prints one JSON object: note latency
percentiles of both phases and their ratio, whether every note was stored in order, whether every
adapter came back byte-identical.

    python benchmarks/hub_load.py [--seconds 10] [--devices 5] [--rate 50] [--adapters 8] [--mb 40]
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from gbray.hub.server import free_port
from gbray.hub.store import Store

PIECE = 16 * 1024 * 1024


def start_hub(root: Path, tokens: list[str]) -> tuple[subprocess.Popen, str, dict]:
    store = Store(root / "hub.db")
    made = {name: store.add_token(name, owner=False) for name in tokens}
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gbray.cli", "hub", "serve", "--db", str(root / "hub.db"),
         "--store", str(root / "store"), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=open(root / "hub.log", "ab"),  # noqa: SIM115 - lives as long as the process
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/docs", timeout=1).ok:
                return proc, url, made
        except requests.RequestException:
            time.sleep(0.2)
    raise RuntimeError("the hub did not start")


def register(url: str, token: str, device: str) -> str:
    r = requests.post(
        url + "/v1/training/rounds",
        json={"device": device, "base": "bench", "turns": 1, "recipe": {}},
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )
    r.raise_for_status()
    return r.json()["id"]


def adapter_body(megabytes: int, seed: int) -> bytes:
    """A valid adapter tgz of `megabytes` (random bytes as the weights: they do not compress)."""
    import random

    import torch
    from safetensors.torch import save

    data = random.Random(seed).randbytes(megabytes * 1024 * 1024 - 4096)
    files = {
        "adapter_config.json": json.dumps({"peft_type": "LORA", "r": 32}).encode(),
        "adapter_model.safetensors": save(
            {"w": torch.frombuffer(bytearray(data), dtype=torch.uint8)}
        ),
    }
    buffer = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0, compresslevel=1) as gz,
        tarfile.open(fileobj=gz, mode="w") as tar,
    ):
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def send_notes(url, token, rid, rate, until, latencies, sent, tag):
    """Notes at `rate` a second until the clock passes `until()`; each one's latency is kept."""
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {token}"
    period, i = 1.0 / rate, 0
    next_at = time.monotonic()
    while time.monotonic() < until():
        line = f"{tag} note {i}"
        started = time.monotonic()
        r = session.post(f"{url}/v1/training/rounds/{rid}/note", json={"line": line}, timeout=30)
        latencies.append(time.monotonic() - started)
        r.raise_for_status()
        sent.append(line)
        i += 1
        next_at += period
        time.sleep(max(0.0, next_at - time.monotonic()))


def upload(url, token, rid, pieces: list[bytes]) -> float:
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {token}"
    started = time.monotonic()
    for i, piece in enumerate(pieces):
        r = session.put(
            f"{url}/v1/training/rounds/{rid}/adapter",
            params={"chunk": i, "of": len(pieces)},
            data=piece,
            timeout=300,
        )
        r.raise_for_status()
    return time.monotonic() - started


def phase(url, tokens, rids, rate, until, tag):
    latencies = {d: [] for d in rids}
    sent = {d: [] for d in rids}
    threads = [
        threading.Thread(
            target=send_notes,
            args=(url, tokens[d], rids[d], rate / len(rids), until, latencies[d], sent[d], tag),
        )
        for d in rids
    ]
    for t in threads:
        t.start()
    return threads, latencies, sent


def percentiles(values: list[float]) -> dict:
    ms = sorted(v * 1000 for v in values)
    q = statistics.quantiles(ms, n=100) if len(ms) >= 2 else ms * 99
    return {
        "n": len(ms),
        "p50_ms": round(q[49], 2),
        "p99_ms": round(q[98], 2),
        "max_ms": round(ms[-1], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the baseline phase")
    parser.add_argument("--devices", type=int, default=5)
    parser.add_argument("--rate", type=float, default=50.0, help="notes a second, all devices")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--mb", type=int, default=40, help="size of each adapter")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="gbray-hub-load-"))
    devices = [f"dev{i}" for i in range(args.devices)]
    proc, url, tokens = start_hub(root, devices)
    try:
        rids = {d: register(url, tokens[d], d) for d in devices}
        bodies = [adapter_body(args.mb, seed) for seed in range(args.adapters)]
        owners = [devices[i % len(devices)] for i in range(args.adapters)]
        upload_rids = [register(url, tokens[d], d + "-upload") for d in owners]

        stop_at = time.monotonic() + args.seconds
        threads, idle, sent_idle = phase(url, tokens, rids, args.rate, lambda: stop_at, "idle")
        for t in threads:
            t.join()

        uploading = threading.Event()
        uploading.set()
        threads, loaded, sent_loaded = phase(
            url, tokens, rids, args.rate, lambda: math.inf if uploading.is_set() else 0, "loaded"
        )
        # Cut before the clock starts: copying 16 MB pieces holds this process's GIL, which
        # would be timed as the hub's latency.
        pieces = [[b[i : i + PIECE] for i in range(0, len(b), PIECE)] for b in bodies]
        started = time.monotonic()
        with ThreadPoolExecutor(args.adapters) as pool:
            took = list(
                pool.map(
                    lambda k: upload(url, tokens[owners[k]], upload_rids[k], pieces[k]),
                    range(args.adapters),
                )
            )
        upload_seconds = time.monotonic() - started
        uploading.clear()
        for t in threads:
            t.join()

        headers = lambda d: {"Authorization": f"Bearer {tokens[d]}"}  # noqa: E731
        in_order = all(
            [
                n["line"]
                for n in requests.get(
                    f"{url}/v1/training/rounds/{rids[d]}", headers=headers(d), timeout=60
                ).json()["notes"]
            ]
            == sent_idle[d] + sent_loaded[d]
            for d in devices
        )
        identical = all(
            requests.get(
                f"{url}/v1/training/adapters/{upload_rids[k]}",
                headers=headers(owners[k]),
                timeout=300,
            ).content
            == bodies[k]
            for k in range(args.adapters)
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    baseline = percentiles([v for d in devices for v in idle[d]])
    figure = percentiles([v for d in devices for v in loaded[d]])
    print(
        json.dumps(
            {
                "benchmark": "hub_load",
                "devices": args.devices,
                "notes_per_second": args.rate,
                "adapters": args.adapters,
                "adapter_mb": round(len(bodies[0]) / 2**20, 1),
                "upload_seconds": round(upload_seconds, 2),
                "slowest_upload_seconds": round(max(took), 2),
                "notes_while_uploading": figure,
                "notes_alone": baseline,
                "p99_ratio": round(figure["p99_ms"] / max(baseline["p99_ms"], 1e-9), 2),
                "p99_below_100_ms": figure["p99_ms"] < 100,
                "every_note_stored_in_order": in_order,
                "every_adapter_byte_identical": identical,
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
