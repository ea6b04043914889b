"""`gbray hub serve` driven the way the field's devices drive it: their exact calls and bodies
(SPEC §8), sent with plain requests, not gbray's client."""

import gzip
import io
import json
import tarfile

import pytest
import requests
import torch
from hubutil import HubProcess
from safetensors.torch import save

from gbray.data.synth import SynthSettings, write_corpus
from gbray.hub.store import Store


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("field-hub")
    write_corpus(
        SynthSettings(
            out=root / "data", turns=1500, eval_turns=150, seed=3, prompt_tokens=80, tools=25
        )
    )
    h = HubProcess(root)
    Store(h.db).load(root / "data" / "train.jsonl", root / "data" / "eval.jsonl")
    h.second = Store(h.db).add_token("desktop", owner=False)
    h.start()
    yield h
    h.stop()


class FieldDevice:
    """The field's client, call for call."""

    def __init__(self, hub, token, name):
        self.url, self.name = hub.url, name
        self.headers = {"Authorization": f"Bearer {token}"}

    def post(self, path, body):
        r = requests.post(self.url + path, json=body, headers=self.headers, timeout=30)
        r.raise_for_status()
        return r.json()

    def get(self, path, **params):
        r = requests.get(self.url + path, params=params, headers=self.headers, timeout=30)
        r.raise_for_status()
        return r

    def register(self, turns):
        recipe = {"hours": 8, "epochs": 3, "lr": 2e-4, "start": "bare"}
        body = {
            "device": self.name,
            "base": "Qwen/Qwen2.5-0.5B-Instruct",
            "turns": turns,
            "recipe": recipe,
        }
        return self.post("/v1/training/rounds", body)["id"]

    def upload(self, rid, tgz):
        r = requests.put(
            f"{self.url}/v1/training/rounds/{rid}/adapter",
            data=tgz,
            headers=self.headers,
            timeout=30,
        )
        r.raise_for_status()


def field_adapter() -> bytes:
    """An adapter tgz as the field packs it: the adapter folder's files at the top."""
    files = {
        "adapter_config.json": json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16}).encode(),
        "adapter_model.safetensors": save({"w": torch.zeros(64)}),
    }
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb") as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def exam(pct, turns=150):
    return {"agreement_pct": pct, "turns": turns, "right": round(pct * turns / 100)}


def night(device, baseline, result):
    """One field round: register, slice and paper, notes, a check, end done, then the adapter."""
    lines = device.get("/v1/training/slice", turns=60, device=device.name).text.splitlines()
    paper = device.get("/v1/training/evalslice", turns=150, device=device.name)
    rid = device.register(len(lines))
    assert device.post(f"/v1/training/rounds/{rid}/note", {"line": "0/180 turn-passes"}) == {}
    check = {"step": 5, "turns": 80, "valLoss": 0.8, "trainLoss": 0.9, "best": True, "lr": 1e-4}
    assert device.post(f"/v1/training/rounds/{rid}/check", check) == {}
    end = {
        "status": "done",
        "baseline": exam(baseline),
        "result": exam(result),
        "adapter": f"C:\\gb\\rounds\\{rid}\\best",
        "paper": paper.headers["X-Exam-Paper"],
        "why": "time: the hours were spent",
        "trained": len(lines),
        "drawSeed": 1234,
    }
    assert device.post(f"/v1/training/rounds/{rid}/end", end) == {}
    device.upload(rid, field_adapter())  # the field ends first and uploads after
    return rid, lines


def test_a_field_devices_winning_round_is_promoted_and_serves(hub):
    device = FieldDevice(hub, hub.device, "field-laptop")
    rid, _ = night(device, baseline=10.0, result=30.67)
    stored = device.get(f"/v1/training/rounds/{rid}").json()
    assert stored["status"] == "done" and stored["baseline"] == 10.0 and stored["result"] == 30.67
    state = device.get("/v1/training/state").json()
    row = next(r for r in state["rounds"] if r["id"] == rid)
    assert row["baseline"] == 10.0 and row["result"] == 30.67
    owner = {"Authorization": f"Bearer {hub.owner}"}
    r = requests.post(f"{hub.url}/v1/training/rounds/{rid}/promote", headers=owner, timeout=30)
    assert r.status_code == 200, r.text
    serving = device.get("/v1/training/serving").json()["serving"]
    assert serving["round"] == rid
    # Any device may start from what serves: fetch it and find the adapter's files at the top.
    tgz = device.get(f"/v1/training/adapters/{serving['adapter']}").content
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(tar.getnames())


def test_a_field_devices_losing_round_gets_409(hub):
    device = FieldDevice(hub, hub.device, "field-laptop")
    rid, _ = night(device, baseline=30.0, result=30.0)
    owner = {"Authorization": f"Bearer {hub.owner}"}
    r = requests.post(f"{hub.url}/v1/training/rounds/{rid}/promote", headers=owner, timeout=30)
    assert r.status_code == 409 and "did not beat" in r.json()["detail"]


def test_a_told_baseline_is_read_back_as_an_object_by_another_device(hub):
    first = FieldDevice(hub, hub.device, "field-laptop")
    second = FieldDevice(hub, hub.second, "field-desktop")
    key = {
        "scope": "hub-x",
        "base": "bare",
        "paper": "p-field",
        "turns": 150,
        "answer": 320,
        "student": "Qwen/Qwen2.5-0.5B-Instruct",
    }
    claim = first.get("/v1/training/baseline", **key, device=first.name).json()
    assert claim == {"known": False, "measure": True, "by": "field-laptop"}
    waiting = second.get("/v1/training/baseline", **key, device=second.name).json()
    assert waiting == {"known": False, "measure": False, "by": "field-laptop"}
    first.post("/v1/training/baseline", {**key, "baseline": exam(12.0)})
    known = second.get("/v1/training/baseline", **key, device=second.name).json()
    # The field's body names no device: the measurer is the token that told it.
    assert known["known"] is True and known["by"] == "laptop"
    assert known["baseline"]["agreement_pct"] == 12.0 and known["baseline"]["turns"] == 150


def test_two_devices_sixty_turn_slices_are_sixty_and_disjoint(hub):
    a = FieldDevice(hub, hub.device, "field-laptop")
    b = FieldDevice(hub, hub.second, "field-desktop")
    got_a = a.get("/v1/training/slice", turns=60, device=a.name).text.splitlines()
    got_b = b.get("/v1/training/slice", turns=60, device=b.name).text.splitlines()
    assert len(got_a) == 60 and len(got_b) == 60
    assert not set(got_a) & set(got_b)
    tools = {json.loads(json.loads(line)["messages"][-1]["content"])["tool"] for line in got_a}
    assert len(tools) >= 20  # the corpus' shape, not one tool
    assert len(a.get("/v1/training/slice", turns=1, device=a.name).text.splitlines()) == 1
