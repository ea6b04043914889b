import gzip
import io
import json
import subprocess
import sys
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from hubutil import HubProcess
from safetensors.torch import save_file

from gbray.hub.client import ClientSettings, HubClient, pack_adapter, unpack_adapter

MB = 1024 * 1024


@pytest.fixture(scope="module")
def hub(tmp_path_factory, corpus):
    root = tmp_path_factory.mktemp("hub")
    h = HubProcess(root, "--size-limit-mb", "40", "--claim-timeout", "3")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gbray.cli",
            "hub",
            "load",
            "--db",
            str(h.db),
            "--train",
            str(corpus / "train.jsonl"),
            "--eval",
            str(corpus / "eval.jsonl"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    h.loaded = json.loads(out.stdout)
    h.start()
    yield h
    h.stop()


def api(hub, method, path, who="device", **kw):
    return requests.request(method, hub.url + path, headers=hub.headers(who), timeout=60, **kw)


def new_round(hub, device="laptop"):
    return api(
        hub,
        "POST",
        "/v1/training/rounds",
        json={"device": device, "base": "bare", "turns": 10, "recipe": {"student": "tiny"}},
    ).json()["id"]


def fast_client(hub, device="laptop") -> HubClient:
    return HubClient(
        ClientSettings(
            url=hub.url,
            token=hub.device,
            device=device,
            must_first_pause=0.5,
            must_max_pause=2,
            must_for=60,
            piece_first_pause=0.2,
            piece_max_pause=1,
            timeout=10,
        )
    )


def test_load_cut_the_paper_by_job(hub):
    assert hub.loaded["train"] > 0 and hub.loaded["eval"] == 150
    r = api(hub, "GET", "/v1/training/evalslice", params={"turns": 150})
    eval_jobs = {json.loads(line)["job"] for line in r.text.splitlines()}
    train = api(hub, "GET", "/v1/training/slice", params={"turns": 50, "device": "probe"})
    assert not eval_jobs & {json.loads(line)["job"] for line in train.text.splitlines()}
    assert r.headers["X-Exam-Paper"].startswith("p-") and r.headers["X-Exam-Scope"].startswith(
        "hub-"
    )


def test_no_token_begins_with_a_dash():
    """A device passes its token as `--token VALUE`; argparse reads "-..." as a flag."""
    from gbray.hub.store import new_token

    assert not any(new_token().startswith("-") for _ in range(2000))


def test_missing_or_wrong_token_is_401_and_changes_nothing(hub):
    before = len(api(hub, "GET", "/v1/training/state").json()["rounds"])
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic x"}):
        r = requests.post(
            hub.url + "/v1/training/rounds", json={"device": "x"}, headers=headers, timeout=10
        )
        assert r.status_code == 401
        assert (
            requests.get(
                hub.url + "/v1/training/slice?turns=5", headers=headers, timeout=10
            ).status_code
            == 401
        )
    assert len(api(hub, "GET", "/v1/training/state").json()["rounds"]) == before


def test_notes_checks_stop_and_end(hub):
    rid = new_round(hub)
    assert api(hub, "POST", f"/v1/training/rounds/{rid}/note", json={"line": "hello"}).json() == {}
    assert (
        api(
            hub,
            "POST",
            f"/v1/training/rounds/{rid}/check",
            json={
                "step": 5,
                "turns": 40,
                "valLoss": 0.5,
                "trainLoss": 0.6,
                "best": True,
                "lr": 1e-3,
            },
        ).json()
        == {}
    )
    assert api(hub, "POST", f"/v1/training/rounds/{rid}/stop").status_code == 403  # a device token
    assert api(hub, "POST", f"/v1/training/rounds/{rid}/stop", who="owner").ok
    assert api(hub, "POST", f"/v1/training/rounds/{rid}/note", json={"line": "more"}).json() == {
        "stop": True
    }
    assert api(
        hub,
        "POST",
        f"/v1/training/rounds/{rid}/end",
        json={
            "status": "stopped",
            "baseline": {"agreement_pct": 1.0, "turns": 10},
            "result": None,
            "paper": "p-x",
            "trained": 3,
        },
    ).ok
    detail = api(hub, "GET", f"/v1/training/rounds/{rid}").json()
    assert [n["line"] for n in detail["notes"]] == ["hello", "more"]
    assert detail["checks"][0]["valLoss"] == 0.5 and detail["checks"][0]["best"] is True
    # The field's check carries no agreement and no phase: both read back as null.
    assert detail["checks"][0]["valAgreement"] is None and detail["checks"][0]["phase"] is None
    assert detail["status"] == "stopped" and detail["baseline"] == 1.0


def test_a_check_carries_the_agreement_and_the_phase(hub):
    rid = new_round(hub)
    point = {"step": 9, "valLoss": 0.4, "best": False, "lr": 2e-4, "valAgreement": 62.5,
             "phase": "cool-down"}  # fmt: skip
    assert api(hub, "POST", f"/v1/training/rounds/{rid}/check", json=point).json() == {}
    for wrong in ({"valAgreement": 100.5}, {"valAgreement": -1}, {"phase": "<b>late</b>"}):
        r = api(hub, "POST", f"/v1/training/rounds/{rid}/check", json={"step": 10, **wrong})
        assert r.status_code == 422, r.text
    (check,) = api(hub, "GET", f"/v1/training/rounds/{rid}").json()["checks"]
    assert check["valAgreement"] == 62.5 and check["phase"] == "cool-down"


def test_concurrent_slices_are_disjoint_and_coverage_counts_trained(hub):
    def take(device):
        r = api(hub, "GET", "/v1/training/slice", params={"turns": 120, "device": device})
        return [json.loads(line) for line in r.text.splitlines()]

    with ThreadPoolExecutor(4) as pool:
        slices = list(pool.map(take, ["a", "b", "c", "d"]))
    keys = [json.dumps(t, sort_keys=True) for s in slices for t in s]
    assert all(len(s) == 120 for s in slices)
    assert len(set(keys)) == len(keys)
    before = api(hub, "GET", "/v1/training/state").json()["coverage"]["trained"]
    for device, trained in (("a", 100), ("b", 37)):
        rid = new_round(hub, device)
        api(
            hub,
            "POST",
            f"/v1/training/rounds/{rid}/end",
            json={"status": "done", "trained": trained},
        )
    coverage = api(hub, "GET", "/v1/training/state").json()["coverage"]
    assert coverage["trained"] == before + 137
    assert coverage["handed_out"] >= 480  # handed out is not trained


def test_one_baseline_measurer_and_the_claim_passes_on(hub):
    key = {
        "scope": "s",
        "base": "bare",
        "paper": "p-1",
        "turns": 100,
        "answer": 320,
        "student": "tiny",
    }

    def ask(device):
        return api(hub, "GET", "/v1/training/baseline", params={**key, "device": device}).json()

    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(ask, ["d1", "d2"]))
    assert sorted(a["measure"] for a in answers) == [False, True]
    measurer = next(a["by"] for a in answers if a["measure"])
    assert all(a["by"] == measurer for a in answers)
    # Another budget or student is another measurement.
    assert (
        ask_other(hub, {**key, "answer": 96})["measure"]
        and ask_other(hub, {**key, "student": "other"})["measure"]
    )
    told = {"agreement_pct": 12.5, "turns": 100}
    assert api(hub, "POST", "/v1/training/baseline", json={**key, "baseline": told}).ok
    assert ask("d3") == {"known": True, "baseline": told, "by": "laptop"}
    # A bare number is not an exam result.
    assert api(hub, "POST", "/v1/training/baseline", json={**key, "baseline": 3}).status_code == 422
    # A claim whose holder went silent (claim timeout 3 s here) passes to the next asker.
    key2 = {**key, "paper": "p-2"}
    assert ask_other(hub, key2, "first")["measure"]
    assert not ask_other(hub, key2, "second")["measure"]
    time.sleep(3.5)
    assert ask_other(hub, key2, "second")["measure"]


def ask_other(hub, key, device="other"):
    return api(hub, "GET", "/v1/training/baseline", params={**key, "device": device}).json()


def fake_adapter(folder, megabytes):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    save_file({"w": torch.rand(megabytes * MB // 4)}, str(folder / "adapter_model.safetensors"))
    return folder


def test_big_adapter_in_pieces_survives_a_hub_restart(hub, tmp_path):
    folder = fake_adapter(tmp_path / "a", 20)
    body = pack_adapter(folder)
    assert len(body) > 16 * MB
    client = fast_client(hub)
    rid = client.register("bare", 10, {})
    # The first piece lands, then the hub goes down for a few seconds mid-upload.
    first = api(
        hub,
        "PUT",
        f"/v1/training/rounds/{rid}/adapter",
        params={"chunk": 0, "of": 2},
        data=body[: 16 * MB],
    )
    assert first.json()["complete"] is False
    hub.stop()
    threading.Timer(3.0, hub.start).start()
    name = client.put_adapter(folder)
    assert name == rid
    got = api(hub, "GET", f"/v1/training/adapters/{rid}").content
    assert got == body
    out = unpack_adapter(_write(tmp_path / "got.tgz", got), tmp_path / "x")
    assert (out / "adapter_model.safetensors").read_bytes() == (
        folder / "adapter_model.safetensors"
    ).read_bytes()


def _write(path, data):
    path.write_bytes(data)
    return path


def _tgz(members):
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb") as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for name, data, kind in members:
            info = tarfile.TarInfo(name)
            if kind == "sym":
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            else:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if kind != "sym" else None)
    return buffer.getvalue()


GOOD = [
    ("adapter_config.json", b"{}", "file"),
    ("adapter_model.safetensors", b"x" * 10, "file"),
]


@pytest.mark.parametrize(
    "case",
    [
        "outside",
        "absolute",
        "link",
        "no-config",
        "nested",
        "not-tgz",
        "over-limit",
        "bad-index",
        "bad-of",
        "big-piece",
        "short-middle-piece",
    ],
)
def test_bad_uploads_are_refused_and_nothing_is_stored(hub, case):
    rid = new_round(hub)
    path = f"/v1/training/rounds/{rid}/adapter"
    if case == "outside":
        r = api(hub, "PUT", path, data=_tgz([*GOOD, ("../../evil.txt", b"x", "file")]))
    elif case == "absolute":
        r = api(hub, "PUT", path, data=_tgz([*GOOD, ("/tmp/evil.txt", b"x", "file")]))
    elif case == "link":
        r = api(hub, "PUT", path, data=_tgz([*GOOD, ("passwd", b"", "sym")]))
    elif case == "no-config":
        r = api(hub, "PUT", path, data=_tgz(GOOD[1:]))
    elif case == "nested":
        # The field's client loads the extracted folder itself: files under a folder are refused.
        r = api(hub, "PUT", path, data=_tgz([("a/" + n, d, k) for n, d, k in GOOD]))
    elif case == "not-tgz":
        r = api(hub, "PUT", path, data=b"hello")
    elif case == "over-limit":
        r = api(hub, "PUT", path, data=b"\0" * (41 * MB))
    elif case == "bad-index":
        r = api(hub, "PUT", path, params={"chunk": 3, "of": 2}, data=b"x")
    elif case == "bad-of":
        r = api(hub, "PUT", path, params={"chunk": 0, "of": 0}, data=b"x")
    elif case == "big-piece":
        r = api(hub, "PUT", path, params={"chunk": 0, "of": 2}, data=b"x" * (16 * MB + 1))
    else:
        r = api(hub, "PUT", path, params={"chunk": 0, "of": 3}, data=b"x" * 100)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert api(hub, "GET", f"/v1/training/adapters/{rid}").status_code == 404
    assert not list((hub.store / "pieces").glob(f"{rid}*/*"))
    assert not list(hub.store.glob("*.upload"))


def test_promotion_only_for_a_round_that_beat_its_baseline(hub, tmp_path):
    from gbray.round import serving_start

    client = fast_client(hub)
    # `--adapter hub:serving` while nothing serves: the night starts from the bare student.
    assert serving_start(client) == (None, None)
    loser = client.register("bare", 10, {})
    client.put_adapter(fake_adapter(tmp_path / "l", 1))
    client.end(
        {
            "status": "done",
            "baseline": {"agreement_pct": 20.0, "turns": 150},
            "result": {"agreement_pct": 20.0, "turns": 150},
            "paper": "p-1",
            "adapter": loser,
        }
    )
    r = api(hub, "POST", f"/v1/training/rounds/{loser}/promote", who="owner")
    assert r.status_code == 409 and "did not beat" in r.json()["detail"]
    running = new_round(hub)
    assert (
        api(hub, "POST", f"/v1/training/rounds/{running}/promote", who="owner").status_code == 409
    )
    winner = client.register("bare", 10, {})
    client.put_adapter(fake_adapter(tmp_path / "w", 1))
    client.end(
        {
            "status": "done",
            "baseline": {"agreement_pct": 5.0, "turns": 150},
            "result": {"agreement_pct": 60.0, "turns": 150},
            "paper": "p-1",
            "adapter": winner,
        }
    )
    assert (
        api(hub, "POST", f"/v1/training/rounds/{winner}/promote").status_code == 403
    )  # device token
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gbray.cli",
            "hub",
            "promote",
            winner,
            "--hub",
            hub.url,
            "--token",
            hub.owner,
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    serving = api(hub, "GET", "/v1/training/serving").json()["serving"]
    assert serving["round"] == winner and serving["result"] == 60.0
    # Once it serves, `hub:serving` is its adapter, named as a night fetches it.
    start, said = serving_start(client)
    assert start == f"hub:{winner}" and said["round"] == winner and said["result"] == 60.0
    assert client.get_adapter(start[4:], tmp_path / "fetched").is_dir()


def test_kept_notes_arrive_in_order_when_the_hub_comes_back(hub):
    client = fast_client(hub)
    rid = client.register("bare", 10, {})
    client.note("n0")
    hub.stop()
    for i in range(1, 6):
        client.note(f"n{i}")
    client.check({"step": 1, "valLoss": 0.9})
    assert len(client.kept) == 6
    # A night that asks what serves while the hub is down does not start from a guess.
    from gbray.data.turns import DataError
    from gbray.round import serving_start

    with pytest.raises(DataError, match="could not ask the hub what serves"):
        serving_start(client)
    hub.start()
    client.note("n6")
    assert not client.kept
    notes = [n["line"] for n in api(hub, "GET", f"/v1/training/rounds/{rid}").json()["notes"]]
    assert notes == [f"n{i}" for i in range(7)]


def test_page_and_openapi(hub):
    page = requests.get(hub.url + "/", timeout=10)
    assert page.ok and "gbray hub" in page.text and "Validation curve" in page.text
    paths = requests.get(hub.url + "/openapi.json", timeout=10).json()["paths"]
    for p in (
        "/v1/training/rounds",
        "/v1/training/rounds/{round_id}/note",
        "/v1/training/slice",
        "/v1/training/evalslice",
        "/v1/training/baseline",
        "/v1/training/rounds/{round_id}/adapter",
        "/v1/training/adapters/{name}",
        "/v1/training/state",
        "/v1/training/rounds/{round_id}/promote",
        "/v1/training/serving",
        "/v1/training/rounds/{round_id}/stop",
    ):
        assert p in paths, p


@pytest.mark.parametrize(
    "members",
    [
        [*GOOD, ("../../../tmp/evil.txt", b"x", "file")],
        [*GOOD, ("link", b"", "sym")],
    ],
)
def test_fetched_adapter_extraction_refuses_escapes_and_links(tmp_path, members):
    from gbray.hub.adapters import Refused

    tgz = _write(tmp_path / "bad.tgz", _tgz(members))
    with pytest.raises(Refused):
        unpack_adapter(tgz, tmp_path / "into")
    assert not (tmp_path / "into").exists() or not any((tmp_path / "into").rglob("*"))


def test_a_revoked_token_is_refused_on_its_next_call_by_a_serving_hub(hub):
    from gbray.hub.store import Store

    lost = Store(hub.db).add_token("lost-phone", owner=False)
    as_lost = {"Authorization": f"Bearer {lost}"}
    rid = requests.post(
        hub.url + "/v1/training/rounds", headers=as_lost, timeout=30,
        json={"device": "phone", "base": "bare", "turns": 10, "recipe": {}},
    ).json()["id"]  # fmt: skip

    def gbray_token(*args):
        return subprocess.run(
            [sys.executable, "-m", "gbray.cli", "hub", "token", *args, "--db", str(hub.db)],
            capture_output=True, text=True,
        )  # fmt: skip

    listed = [json.loads(line) for line in gbray_token("list").stdout.splitlines()]
    assert {"name": "lost-phone", "owner": False} in [
        {k: t[k] for k in ("name", "owner")} for t in listed
    ]
    assert lost not in json.dumps(listed) and hub.owner not in json.dumps(listed)
    # The hub answered this token a moment ago (and reuses that answer for a few seconds).
    assert requests.get(hub.url + "/v1/whoami", headers=as_lost, timeout=30).status_code == 200
    revoked = gbray_token("revoke", "lost-phone")
    assert revoked.returncode == 0 and json.loads(revoked.stdout) == {"revoked": "lost-phone"}
    refused = requests.post(
        hub.url + f"/v1/training/rounds/{rid}/note", headers=as_lost, timeout=30,
        json={"line": "still here"},
    )  # fmt: skip
    assert refused.status_code == 401
    assert "lost-phone" not in gbray_token("list").stdout
    # Its round stays, for the owner; the other devices are not touched.
    assert api(hub, "GET", f"/v1/training/rounds/{rid}", who="owner").status_code == 200
    assert api(hub, "GET", "/v1/whoami").status_code == 200
    unknown = gbray_token("revoke", "no-such-device")
    assert unknown.returncode == 1 and "no token named 'no-such-device'" in unknown.stderr


def test_a_backup_taken_while_a_round_uploads_restores_every_ended_round(hub, tmp_path):
    import sqlite3

    ended = fast_client(hub)
    ended.register("bare", 10, {})
    for i in range(3):
        ended.note(f"line {i}")
        ended.check({"step": i + 1, "valLoss": 1.0 / (i + 1), "valAgreement": 10.0 * i})
    ended.put_adapter(fake_adapter(tmp_path / "ended", 2))
    ended.end({"status": "done", "baseline": None, "result": None, "adapter": ended.round_id})
    uploading = fast_client(hub)
    uploading.register("bare", 10, {})
    upload = threading.Thread(
        target=uploading.put_adapter, args=(fake_adapter(tmp_path / "big", 30),)
    )
    upload.start()
    try:
        taken = subprocess.run(
            [sys.executable, "-m", "gbray.cli", "hub", "backup", "--db", str(hub.db),
             "--store", str(hub.store), "--to", str(tmp_path / "backup")],
            capture_output=True, text=True,
        )  # fmt: skip
    finally:
        upload.join()
    assert taken.returncode == 0, taken.stderr
    began = json.loads(taken.stdout)["began"]
    root = tmp_path / "restored"
    restored = subprocess.run(
        [sys.executable, "-m", "gbray.cli", "hub", "restore", "--from", str(tmp_path / "backup"),
         "--db", str(root / "hub.db"), "--store", str(root / "store")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert restored.returncode == 0, restored.stderr
    again = subprocess.run(
        [sys.executable, "-m", "gbray.cli", "hub", "restore", "--from", str(tmp_path / "backup"),
         "--db", str(root / "hub.db"), "--store", str(root / "store")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert again.returncode != 0 and "exists" in again.stderr  # never over a hub
    with sqlite3.connect(hub.db) as db:
        before = [r[0] for r in db.execute("SELECT id FROM rounds WHERE ended < ?", (began,))]
    assert ended.round_id in before
    copy = HubProcess(root).start()
    try:
        for rid in before:
            path = f"/v1/training/rounds/{rid}"
            mine = api(hub, "GET", path, who="owner").json()
            theirs = api(copy, "GET", path, who="owner").json()
            for field in ("status", "notes", "checks", "result", "baseline", "end_body"):
                assert mine[field] == theirs[field], (rid, field)
            original = api(hub, "GET", f"/v1/training/adapters/{rid}")
            if original.status_code == 200:
                assert api(copy, "GET", f"/v1/training/adapters/{rid}").content == original.content
    finally:
        copy.stop()
