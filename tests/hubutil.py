"""A real hub server in a subprocess on 127.0.0.1, with a real SQLite file."""

import os
import subprocess
import sys
import time
from pathlib import Path

import requests

from gbray.hub.server import free_port


class HubProcess:
    def __init__(self, root: Path, *extra: str):
        self.root = Path(root)
        self.db, self.store = self.root / "hub.db", self.root / "store"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra = extra
        self.proc = None
        self.verify = True  # a TLS hub's test sets its https:// url and its CA here
        from gbray.hub.store import Store

        store = Store(self.db)
        self.owner = store.add_token("owner", owner=True)
        self.device = store.add_token("laptop", owner=False)

    def start(self) -> "HubProcess":
        # stdout too: uvicorn writes its access log there.
        self.log = open(self.root / "hub.log", "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gbray.cli",
                "hub",
                "serve",
                "--db",
                str(self.db),
                "--store",
                str(self.store),
                "--port",
                str(self.port),
                *self.extra,
            ],
            stdout=self.log,
            stderr=self.log,
            env={**os.environ},
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if requests.get(self.url + "/docs", timeout=1, verify=self.verify).ok:
                    return self
            except requests.RequestException:
                time.sleep(0.2)
        raise RuntimeError("hub did not start: " + (self.root / "hub.log").read_text()[-2000:])

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=15)

    def headers(self, who: str = "device") -> dict:
        return {"Authorization": f"Bearer {self.owner if who == 'owner' else self.device}"}
