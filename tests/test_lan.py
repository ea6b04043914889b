"""A cluster as a user's LAN is: a head and two workers, each in a network namespace of its own
with its own address on one bridge (veth pairs, addresses of the test's own, traffic only between
them), each with its own temporary folder, started with `ray start`. A shares night is launched
from the head with `--address auto`, and one worker's namespace is taken down mid-night (its
processes killed, its link gone): the night ends done and round.json names the lost worker.

Needs root and `ip netns` (this machine and CI both run as root); elsewhere it skips, saying why.
"""

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PREFIX = "gbl"
SUBNET = "10.213.7"
NODES = {"head": 1, "w1": 2, "w2": 3}  # namespace -> last octet


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def can_make_namespaces() -> str | None:
    if shutil.which("ip") is None:
        return "needs the ip command (iproute2)"
    if os.geteuid() != 0:
        return "needs root to make network namespaces"
    return None


# Ray turns on token authentication for a cluster on a non-local address: every machine and the
# driver carry the cluster's token, as a user's LAN does.
AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}


def node_env(node: str, tmp: Path) -> dict:
    return {**os.environ, **AUTH, "RAY_TMPDIR": str(tmp / node)}


def in_ns(node: str, *command: str, tmp: Path, **kw) -> subprocess.CompletedProcess:
    env = node_env(node, tmp)
    return subprocess.run(["ip", "netns", "exec", f"{PREFIX}-{node}", *command], env=env, **kw)


def take_down(node: str) -> None:
    """The machine goes away: every process in its namespace killed, then the namespace (and
    its end of the link) removed."""
    ns = f"{PREFIX}-{node}"
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    for pid in pids.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def lan():
    why = can_make_namespaces()
    if why:
        pytest.skip(why)
    # Short: Ray's socket paths under it must stay within the 107 characters a socket allows.
    tmp_path = Path(tempfile.mkdtemp(prefix="gbl-", dir="/tmp"))
    made = []
    try:
        ip("netns", "add", f"{PREFIX}-lan")
        made.append("lan")
        ip("-n", f"{PREFIX}-lan", "link", "add", "br0", "type", "bridge")
        ip("-n", f"{PREFIX}-lan", "link", "set", "br0", "up")
        for node, octet in NODES.items():
            ns, inside, outside = f"{PREFIX}-{node}", f"{PREFIX}-{node}-e", f"{PREFIX}-{node}-b"
            ip("netns", "add", ns)
            made.append(node)
            ip("link", "add", inside, "type", "veth", "peer", "name", outside)
            ip("link", "set", inside, "netns", ns)
            ip("link", "set", outside, "netns", f"{PREFIX}-lan")
            ip("-n", f"{PREFIX}-lan", "link", "set", outside, "master", "br0")
            ip("-n", f"{PREFIX}-lan", "link", "set", outside, "up")
            ip("-n", ns, "addr", "add", f"{SUBNET}.{octet}/24", "dev", inside)
            ip("-n", ns, "link", "set", inside, "up")
            ip("-n", ns, "link", "set", "lo", "up")
            (tmp_path / node).mkdir()
        yield tmp_path
    finally:
        for node in reversed(made):
            take_down(node)
        shutil.rmtree(tmp_path, ignore_errors=True)


def ray_start(node: str, tmp: Path, *args: str) -> None:
    ray = str(Path(sys.executable).with_name("ray"))
    run = in_ns(
        node, ray, "start", "--node-ip-address", f"{SUBNET}.{NODES[node]}",
        "--disable-usage-stats", *args, tmp=tmp, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, (
        f"ray start on {node} failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}"
    )


def node_addresses(tmp: Path) -> dict[str, str]:
    probe = (
        "import json, ray; ray.init(address='auto', logging_level='ERROR'); "
        "print(json.dumps({n['NodeID']: n['NodeManagerAddress'] for n in ray.nodes()}))"
    )
    run = in_ns("head", sys.executable, "-c", probe, tmp=tmp, capture_output=True, text=True,
                timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_shares_night_on_a_lan_of_three_machines_loses_one(lan, learnable):
    corpus, student = learnable
    tmp = lan
    # The head trains nothing (no CPU for shares): one share on each worker.
    ray_start("head", tmp, "--head", "--port", "6379", "--num-cpus", "0", "--include-dashboard",
              "false", "--resources", '{"head": 1}')  # fmt: skip
    for worker in ("w1", "w2"):
        ray_start(worker, tmp, "--address", f"{SUBNET}.1:6379", "--num-cpus", "1",
                  "--resources", json.dumps({worker: 1}))  # fmt: skip
    addresses = node_addresses(tmp)
    assert sorted(addresses.values()) == [f"{SUBNET}.{o}" for o in (1, 2, 3)]
    out = tmp / "night"
    driver = subprocess.Popen(
        [
            "ip", "netns", "exec", f"{PREFIX}-head", sys.executable, "-m", "gbray.cli", "round",
            "--address", "auto", "--shares", "2", "--data", str(corpus), "--model", str(student),
            "--out", str(out), "--hours", str(1.0 / 60), "--epochs", "50", "--turns", "240",
            "--lr", "3e-3", "--batch", "4", "--accum", "1", "--lora-r", "8", "--lora-alpha", "16",
            "--max-len", "384", "--val-every-minutes", "0.25", "--exam-turns", "40",
            "--answer-budget", "24", "--seed", "5", "--threads", "1", "--skip-baseline",
            "--no-gradient-checkpointing", "--precision", "float32", "--share-grace", "5",
        ],
        env=node_env("head", tmp),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        # Once both shares have synced, the second worker's machine goes away.
        logs = [out / f"share-{i}" / "progress.log" for i in range(2)]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not all(
            p.is_file() and "synced with the other shares" in p.read_text() for p in logs
        ):
            assert driver.poll() is None, driver.stdout.read()[-3000:]
            time.sleep(0.5)
        take_down("w2")
        output, _ = driver.communicate(timeout=600)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, output[-3000:]
    record = json.loads((out / "round.json").read_text())
    assert record["status"] == "done"
    nodes = [r["node"] for r in record["share_reports"]]
    assert sorted(addresses[n] for n in nodes) == [f"{SUBNET}.2", f"{SUBNET}.3"]
    # The lost worker is named, and what its share synced before it went is in the result.
    [lost] = record["lost_shares"]
    assert addresses[lost["node"]] == f"{SUBNET}.3" and lost["why"]
    members = {m["share"]: m for m in record["merge"]["members"]}
    assert members[lost["share"]]["turns_synced"] > 0
    assert record["result"]["turns"] == 40
