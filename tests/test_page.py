"""The status page in headless Chromium, on a round whose device sent markup in every field it can
send: the markup shows as text and none of it runs."""

import shutil
import subprocess

import pytest
import requests
from hubutil import HubProcess

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (.ci/run installs it)")

# Each payload tries to run script or to add an element the page never makes.
PAYLOADS = [
    "<img src=x onerror=\"document.body.setAttribute('data-pwned', 'img')\">",
    "<script>document.body.setAttribute('data-pwned', 'script')</script>",
    '<b id="pwned-b">bold</b>',
    "\"><svg onload=\"document.body.setAttribute('data-pwned', 'svg')\">",
]


def markup(i: int) -> str:
    return PAYLOADS[i % len(PAYLOADS)] + f" #{i}"


def test_device_markup_is_shown_as_text_and_never_run(tmp_path):
    from test_field import field_adapter

    # Unattended: the round is put to the gate when its adapter lands, so the page's history
    # shows the refusal, with the device's paper, as text.
    hub = HubProcess(tmp_path, "--auto-promote").start()
    try:
        auth = {"Authorization": f"Bearer {hub.device}"}

        def post(path, body):
            r = requests.post(hub.url + path, json=body, headers=auth, timeout=30)
            assert r.status_code == 200, r.text
            return r.json()

        rid = post(
            "/v1/training/rounds",
            {
                "device": markup(0),
                "base": markup(1),
                "turns": 10,
                "recipe": {"student": markup(2), "start": markup(3), "trial": markup(4)},
            },
        )["id"]
        post(f"/v1/training/rounds/{rid}/note", {"line": markup(5)})
        post(f"/v1/training/rounds/{rid}/check", {"step": 1, "valLoss": 0.5, "trainLoss": 0.6})
        post(
            f"/v1/training/rounds/{rid}/check",
            {"step": 2, "valLoss": 0.4, "valAgreement": 40.0, "phase": "cool-down", "best": True},
        )
        post(
            f"/v1/training/rounds/{rid}/end",
            {
                "status": "done",
                "baseline": {"agreement_pct": 10.0, "turns": 150, "note": markup(6)},
                "result": {"agreement_pct": 20.0, "turns": 150, "note": markup(7)},
                "adapter": markup(8),
                "paper": markup(9),
                "why": markup(10),
                "trained": 10,
                "perTool": {
                    markup(11): {"asked": markup(12), "before": markup(13), "after": markup(14)}
                },
                "newTools": {
                    "tools": [markup(15)],
                    "asked": 40,
                    "before": 1,
                    "after": 12,
                    "before_pct": 2.5,
                    "after_pct": 30.0,
                },
            },
        )
        landed = requests.put(
            hub.url + f"/v1/training/rounds/{rid}/adapter", data=field_adapter(), headers=auth,
            timeout=30,
        )  # fmt: skip
        assert landed.status_code == 200, landed.text
        dom = subprocess.run(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={tmp_path / 'chromium'}",
                "--virtual-time-budget=8000",
                "--dump-dom",
                f"{hub.url}/?token={hub.owner}&round={rid}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
    finally:
        hub.stop()
    assert rid in dom, dom[:2000]  # the page rendered the rounds and the detail
    assert "data-pwned" not in dom.split("<body", 1)[1].split(">", 1)[0], "a payload ran"
    assert '<b id="pwned-b">' not in dom and "<b " not in dom
    assert "<img" not in dom and "<svg onload" not in dom.lower()
    shown = sum(f"#{i}" in dom for i in range(16))
    # Every field the page shows holds its markup as text (escaped in the dump).
    for i in (0, 3, 5, 10, 11, 13, 14, 15):
        assert f"#{i}" in dom, (i, shown)
    # The round's agreement on tools its slice never held.
    assert "new tools (never in its slice" in dom and "2.5% before → 30.0% after" in dom
    assert "&lt;img src=x onerror=" in dom
    # The curve drew the agreement (its right axis) and shaded the cool-down.
    assert "100%" in dom and "#fdf1dc" in dom
    # What serves over time: the refusal is a cross on the plot and a row naming its rule.
    history = dom.split('id="served"', 1)[1].split('id="served-tools"', 1)[0]
    assert "<path" in history and "refused" in history and "significance:" in history
    assert "#9" in history  # the device's paper, as text
