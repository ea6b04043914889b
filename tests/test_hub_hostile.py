"""The hub against a device that attacks it, crashes, and garbage (SPEC §8 "Everything a device
sends is untrusted"). A real server on 127.0.0.1 and a real SQLite file; each test makes one
defect happen and checks that nothing was taken or lost."""

import gzip
import io
import json
import socket
import subprocess
import sys
import tarfile
import threading
import time
import zlib

import psutil
import pytest
import requests
import torch
from hubutil import HubProcess
from safetensors.torch import save

from gbray.hub.client import pack_adapter
from gbray.hub.store import Store

MB = 1024 * 1024


@pytest.fixture(scope="module")
def hub(tmp_path_factory, corpus):
    root = tmp_path_factory.mktemp("hostile")
    h = HubProcess(root, "--size-limit-mb", "40")
    store = Store(h.db)
    store.load(corpus / "train.jsonl", corpus / "eval.jsonl")
    h.other = store.add_token("desktop", owner=False)
    h.start()
    yield h
    h.stop()


def call(hub, method, path, token=None, **kw):
    token = hub.device if token is None else token
    headers = {**kw.pop("headers", {}), "Authorization": f"Bearer {token}"}
    return requests.request(method, hub.url + path, headers=headers, timeout=60, **kw)


def register(hub, token=None, device="laptop"):
    body = {"device": device, "base": "Qwen/Qwen2.5-0.5B-Instruct", "turns": 10, "recipe": {}}
    r = call(hub, "POST", "/v1/training/rounds", token, json=body)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def end_body(result=30.0, baseline=10.0):
    return {
        "status": "done",
        "baseline": {"agreement_pct": baseline, "turns": 150},
        "result": {"agreement_pct": result, "turns": 150},
        "paper": "p-1",
        "why": "time",
        "trained": 10,
        "drawSeed": 1,
    }


def adapter_tgz(seed: float = 0.0, size: int = 256) -> bytes:
    """A valid adapter tgz of `size` random float32 weights (random: it does not compress)."""
    weights = torch.rand(size, generator=torch.Generator().manual_seed(int(seed * 1000)))
    members = {
        "adapter_config.json": json.dumps({"peft_type": "LORA", "r": 8}).encode(),
        "adapter_model.safetensors": save({"w": weights}),
    }
    return tgz(members)


def tgz(members: dict) -> bytes:
    buffer = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w") as tar,
    ):
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def state_is_readable(hub):
    r = call(hub, "GET", "/v1/training/state", hub.owner)
    assert r.status_code == 200, r.text
    return r.json()


# -- ownership and order ---------------------------------------------------------------------


def test_a_device_cannot_write_another_devices_round(hub):
    rid = register(hub)
    path = f"/v1/training/rounds/{rid}"
    for method, sub, kw in (
        ("POST", "/note", {"json": {"line": "not mine"}}),
        ("POST", "/check", {"json": {"step": 1, "valLoss": 0.1}}),
        ("POST", "/end", {"json": end_body(99.0, 0.0)}),
        ("PUT", "/adapter", {"data": adapter_tgz(1.0)}),
        ("PUT", "/adapter?part=last", {"data": adapter_tgz(1.0)}),
        ("PUT", "/adapter?chunk=0&of=1", {"data": adapter_tgz(1.0)}),
    ):
        r = call(hub, method, path + sub, hub.other, **kw)
        assert r.status_code == 403, (sub, r.status_code, r.text)
    stored = call(hub, "GET", path).json()
    assert stored["status"] == "running" and stored["notes"] == [] and stored["checks"] == []
    assert call(hub, "GET", f"/v1/training/adapters/{rid}").status_code == 404
    # The round's own token and an owner may write it.
    assert call(hub, "POST", path + "/note", json={"line": "mine"}).status_code == 200
    assert call(hub, "POST", path + "/note", hub.owner, json={"line": "owner"}).status_code == 200


def test_a_round_ends_once(hub):
    rid = register(hub)
    path = f"/v1/training/rounds/{rid}/end"
    assert call(hub, "POST", path, json=end_body(30.0)).status_code == 200
    assert call(hub, "POST", path, json=end_body(30.0)).status_code == 200  # a retry
    again = call(hub, "POST", path, json=end_body(90.0))
    assert again.status_code == 409 and "ended" in again.json()["detail"]
    assert call(hub, "GET", f"/v1/training/rounds/{rid}").json()["result"] == 30.0


def test_a_complete_adapter_is_never_replaced(hub):
    rid = register(hub)
    path = f"/v1/training/rounds/{rid}/adapter"
    first = adapter_tgz(1.0)
    assert call(hub, "PUT", path, data=first).status_code == 200
    assert call(hub, "PUT", path, data=first).status_code == 200  # the same bytes: a retry
    assert call(hub, "PUT", path, data=adapter_tgz(2.0)).status_code == 409
    assert call(hub, "PUT", path + "?chunk=0&of=1", data=adapter_tgz(2.0)).status_code == 409
    assert call(hub, "GET", f"/v1/training/adapters/{rid}").content == first
    # The last checkpoint may be replaced.
    for fill in (3.0, 4.0):
        assert call(hub, "PUT", path + "?part=last", data=adapter_tgz(fill)).status_code == 200
    assert call(hub, "GET", f"/v1/training/adapters/{rid}-last").content == adapter_tgz(4.0)


def test_what_serves_cannot_change_under_the_owner(hub):
    rid = register(hub)
    assert call(hub, "POST", f"/v1/training/rounds/{rid}/end", json=end_body()).status_code == 200
    winner = adapter_tgz(5.0)
    assert call(hub, "PUT", f"/v1/training/rounds/{rid}/adapter", data=winner).status_code == 200
    assert call(hub, "POST", f"/v1/training/rounds/{rid}/promote", hub.owner).status_code == 200
    for token in (hub.device, hub.other):
        r = call(hub, "PUT", f"/v1/training/rounds/{rid}/adapter", token, data=adapter_tgz(6.0))
        assert r.status_code in (403, 409), r.status_code
    served = call(hub, "GET", "/v1/training/serving").json()["serving"]["adapter"]
    assert call(hub, "GET", f"/v1/training/adapters/{served}").content == winner


def test_pieces_of_two_uploads_to_one_name_do_not_mix(hub):
    rid = register(hub)
    path = f"/v1/training/rounds/{rid}/adapter?part=last"
    one, two = (adapter_tgz(seed, size=9 * MB) for seed in (1.0, 2.0))  # 36 MB: three pieces
    piece = 16 * MB
    assert 2 * piece < len(one) and 2 * piece < len(two)

    def put(body, i):
        r = call(hub, "PUT", path + f"&chunk={i}&of=3", data=body[i * piece : (i + 1) * piece])
        assert r.status_code == 200, r.text
        return r.json()["complete"]

    assert not put(one, 0) and not put(one, 1)
    # A second upload begins (a new first piece) before the first finished, and its last piece
    # comes before its middle one: nothing of the first upload may fill the gap.
    assert not put(two, 0) and not put(two, 2)
    assert put(two, 1)
    assert call(hub, "GET", f"/v1/training/adapters/{rid}-last").content == two


# -- numbers and strings ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "where,body",
    [
        ("register", '{"device": "x", "base": "b", "turns": 1, "recipe": {"lr": NaN}}'),
        ("check", '{"step": 1, "valLoss": Infinity}'),
        ("check", '{"step": 1, "valLoss": 0.1, "lr": -Infinity}'),
        ("end", '{"status": "done", "baseline": {"agreement_pct": Infinity, "turns": 1}}'),
        ("end", '{"status": "done", "result": {"agreement_pct": 30, "turns": 1, "x": NaN}}'),
        ("end", '{"status": "done", "result": {"agreement_pct": 130, "turns": 1}}'),
        ("baseline", None),
        ("note", '{"line": "\\ud800 a lone surrogate"}'),
        ("register", '{"device": "x", "base": "b", "turns": 1000000000000000000000000000000}'),
    ],
)
def test_numbers_and_strings_json_cannot_hold_are_refused(hub, where, body):
    rid = register(hub)
    path = {
        "register": "/v1/training/rounds",
        "check": f"/v1/training/rounds/{rid}/check",
        "end": f"/v1/training/rounds/{rid}/end",
        "note": f"/v1/training/rounds/{rid}/note",
        "baseline": "/v1/training/baseline",
    }[where]
    if body is None:
        body = (
            '{"scope": "s", "base": "bare", "paper": "p", "turns": 1, "answer": 320, '
            '"student": "s", "baseline": {"agreement_pct": NaN, "turns": 1}}'
        )
    r = call(hub, "POST", path, data=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 422, (r.status_code, r.text)
    assert isinstance(r.json()["detail"], str) and "\n" not in r.json()["detail"]
    state_is_readable(hub)
    assert call(hub, "GET", f"/v1/training/rounds/{rid}").status_code == 200


@pytest.mark.parametrize(
    "path",
    [
        "/v1/training/baseline?scope=s&base=b&paper=p&turns=1000000000000000000000000000000"
        "&answer=320&student=s",
        "/v1/training/slice?turns=1000000000000000000000000000000",
        "/v1/training/adapters/" + "a" * 300,
        "/v1/training/rounds/" + "r" * 300,
    ],
)
def test_out_of_range_requests_are_4xx_not_500(hub, path):
    r = call(hub, "GET", path)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)


def test_a_note_line_is_bounded(hub):
    rid = register(hub)
    path = f"/v1/training/rounds/{rid}/note"
    assert call(hub, "POST", path, json={"line": "x" * 20 * MB}).status_code == 413
    assert call(hub, "POST", path, json={"line": "x" * 10_000}).status_code == 422
    assert call(hub, "GET", f"/v1/training/rounds/{rid}").json()["notes"] == []


# -- bodies judged before they are read ---------------------------------------------------------


def raw_request(hub, head: str, body_prefix: bytes = b"") -> tuple[str, float]:
    """Send a request's head (and a little of its body), read the answer; (status line, seconds)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", hub.port), timeout=10) as s:
        s.sendall(head.encode() + body_prefix)
        answer = s.recv(4096).decode(errors="replace")
    return answer.split("\r\n", 1)[0], time.monotonic() - started


def test_a_big_body_without_a_token_is_refused_before_it_is_read(hub):
    rid = register(hub)
    memory = psutil.Process(hub.proc.pid).memory_info().rss
    head = (
        f"PUT /v1/training/rounds/{rid}/adapter HTTP/1.1\r\nHost: x\r\n"
        f"Content-Length: {200 * MB}\r\n\r\n"
    )
    status, took = raw_request(hub, head, b"\0" * 65536)
    assert " 401 " in status and took < 5, (status, took)
    head = (
        f"POST /v1/training/rounds/{rid}/note HTTP/1.1\r\nHost: x\r\nContent-Length: {200 * MB}\r\n"
    )
    status, took = raw_request(hub, head + f"Authorization: Bearer {hub.device}\r\n\r\n")
    assert " 413 " in status and took < 5, (status, took)
    assert psutil.Process(hub.proc.pid).memory_info().rss - memory < 50 * MB


# -- archives -----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["crc", "middle"])
def test_an_archive_with_one_byte_flipped_is_refused(hub, where):
    rid = register(hub)
    body = bytearray(adapter_tgz(7.0, size=4096))
    at = len(body) - 6 if where == "crc" else len(body) // 2
    body[at] ^= 0x01
    r = call(hub, "PUT", f"/v1/training/rounds/{rid}/adapter", data=bytes(body))
    assert r.status_code == 400, (r.status_code, r.text)
    assert call(hub, "GET", f"/v1/training/adapters/{rid}").status_code == 404


def test_a_safetensors_file_that_does_not_parse_is_refused(hub):
    rid = register(hub)
    bad = tgz({"adapter_config.json": b"{}", "adapter_model.safetensors": b"\xff" * 64})
    r = call(hub, "PUT", f"/v1/training/rounds/{rid}/adapter", data=bad)
    assert r.status_code == 400 and "safetensors" in r.json()["detail"]


def test_a_valid_adapter_with_a_header_over_a_mebibyte_lands_and_a_lying_header_is_named(hub):
    # A header of 1.5 MiB (its metadata) that describes its file exactly is a valid adapter.
    big = save({"w": torch.rand(64)}, metadata={"note": "x" * (3 * MB // 2)})
    rid = register(hub)
    members = {"adapter_config.json": b'{"peft_type": "LORA"}', "adapter_model.safetensors": big}
    r = call(hub, "PUT", f"/v1/training/rounds/{rid}/adapter", data=tgz(members))
    assert r.status_code == 200, r.text
    # A header that claims more bytes than its file holds is refused for exactly that.
    lying = (10 * MB).to_bytes(8, "little") + b"{}" + b" " * 62
    members["adapter_model.safetensors"] = lying
    r = call(hub, "PUT", f"/v1/training/rounds/{register(hub)}/adapter", data=tgz(members))
    assert r.status_code == 400 and "does not fit the file" in r.json()["detail"], r.text


def gzip_bomb(expanded: int) -> bytes:
    """A tgz whose one member is `expanded` zero bytes: small on the wire, huge unpacked."""
    head = tarfile.TarInfo("adapter_model.safetensors")
    head.size = expanded
    config = tarfile.TarInfo("adapter_config.json")
    config.size = 2
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    out = [packer.compress(config.tobuf() + b"{}" + b"\0" * 510 + head.tobuf())]
    zeros = b"\0" * MB
    for _ in range(expanded // MB):
        out.append(packer.compress(zeros))
    out.append(packer.flush())
    return b"".join(out)


def test_an_archive_that_expands_past_the_limit_is_refused_without_stalling_others(hub):
    rid = register(hub)
    bomb = gzip_bomb(400 * MB)  # the test hub's limit is 40 MB
    assert len(bomb) < 2 * MB
    latencies = []
    answer = {}

    def upload():
        answer["r"] = call(hub, "PUT", f"/v1/training/rounds/{rid}/adapter", data=bomb)

    uploader = threading.Thread(target=upload)
    uploader.start()
    while uploader.is_alive():
        started = time.monotonic()
        call(hub, "POST", f"/v1/training/rounds/{rid}/note", json={"line": "still here"})
        latencies.append(time.monotonic() - started)
    uploader.join()
    assert answer["r"].status_code == 413, answer["r"].text
    assert max(latencies) < 1.0, max(latencies)


# -- slices -------------------------------------------------------------------------------------


def test_slices_are_capped_to_what_is_untaken_and_marks_stay(tmp_path, corpus):
    h = HubProcess(tmp_path)
    Store(h.db).load(corpus / "train.jsonl", corpus / "eval.jsonl")
    total = Store(h.db).coverage()["corpus"]
    h.start()
    try:
        one = call(h, "GET", "/v1/training/slice?turns=1&device=a").text.splitlines()
        assert len(one) == 1
        rest = call(h, "GET", "/v1/training/slice?turns=100000&device=a").text.splitlines()
        assert len(rest) <= total - 1
        assert not set(one) & set(rest)
        later = call(h, "GET", "/v1/training/slice?turns=50&device=b").text.splitlines()
        assert not set(later) & (set(one) | set(rest))  # marks were not cleared by a device
        assert len(one) + len(rest) + len(later) <= total
    finally:
        h.stop()
    # Only the owner, on the hub's machine, clears the marks.
    cleared = subprocess.run(
        [sys.executable, "-m", "gbray.cli", "hub", "marks", "clear", "--db", str(h.db)],
        capture_output=True,
        text=True,
    )
    assert cleared.returncode == 0, cleared.stderr
    assert Store(h.db).coverage()["handed_out"] == 0


# -- crashes and logs ---------------------------------------------------------------------------


def test_start_up_cleans_what_a_crash_left(tmp_path):
    h = HubProcess(tmp_path)
    h.start()
    rid = register(h)
    h.stop()
    (h.store / "tmpabc.upload").write_bytes(b"\0" * MB)
    wedged = h.store / "pieces" / f"{rid}-last"
    wedged.mkdir(parents=True)
    (wedged / "marker.json").write_text('{"of": 2, "tok')  # half-written
    (wedged / "data.upload").write_bytes(b"x" * 10)
    (wedged / "0.done").touch()
    (wedged / "1.tmp").write_bytes(b"x" * 10)
    h.start()
    try:
        assert not list(h.store.glob("*.upload")) and not list(wedged.glob("*.tmp"))
        body = adapter_tgz(8.0)
        r = call(h, "PUT", f"/v1/training/rounds/{rid}/adapter?part=last&chunk=0&of=1", data=body)
        assert r.status_code == 200, r.text
        assert call(h, "GET", f"/v1/training/adapters/{rid}-last").content == body
    finally:
        h.stop()


def test_the_owner_token_stays_out_of_the_access_log(hub):
    assert requests.get(f"{hub.url}/?token={hub.owner}&round=x", timeout=10).ok
    time.sleep(0.5)
    assert hub.owner not in (hub.root / "hub.log").read_text()


def test_the_page_forbids_inline_script(hub):
    page = requests.get(hub.url + "/", timeout=10)
    policy = page.headers["Content-Security-Policy"]
    assert (
        "script-src 'self'" in policy
        and "unsafe-inline" not in policy.split("script-src")[1].split(";")[0]
    )
    assert "<script>" not in page.text
    assert requests.get(hub.url + "/page.js", timeout=10).ok


def test_gbrays_own_upload_still_lands(hub, tmp_path):
    rid = register(hub)
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (folder / "adapter_model.safetensors").write_bytes(save({"w": torch.rand(1000)}))
    body = pack_adapter(folder)
    assert call(hub, "PUT", f"/v1/training/rounds/{rid}/adapter", data=body).status_code == 200


def test_a_share_is_shown_beside_its_merge_only_when_one_device_registered_both(hub):
    def round_with(recipe, token=None):
        body = {"device": "laptop", "base": "Qwen/Qwen2.5-0.5B-Instruct", "turns": 10,
                "recipe": recipe}  # fmt: skip
        r = call(hub, "POST", "/v1/training/rounds", token, json=body)
        assert r.status_code == 200, r.text
        return r.json()["id"]

    merge = round_with({"merge_of": 2})
    mine = round_with({"share": 1, "of": 2, "share_of": merge})
    # Another device names the laptop's merge (under the laptop's name), or sends junk.
    theirs = round_with({"share": 0, "share_of": merge}, hub.other)
    junk = round_with({"share": "<b>0</b>", "share_of": ["x"], "merge_of": "many"}, hub.other)
    rows = {r["id"]: r for r in call(hub, "GET", "/v1/training/state", hub.owner).json()["rounds"]}
    assert rows[merge]["merge_of"] == 2 and rows[merge]["share_of"] is None
    assert (rows[mine]["share"], rows[mine]["share_of"]) == (1, merge)
    assert (rows[theirs]["share"], rows[theirs]["share_of"]) == (0, None)
    assert (rows[junk]["share"], rows[junk]["share_of"], rows[junk]["merge_of"]) == (
        None,
        None,
        None,
    )
    assert all("token" not in r for r in rows.values())
