"""The device side of the hub protocol (SPEC §8). Every call is best effort: a failure is
logged, never raised. Notes and checks that could not be sent are kept and sent in order when
the hub answers again. The round's end and its adapter are retried with growing pauses (the hub
restarts for about a minute on every deploy); adapters over 16 MB go in 16 MB pieces.
"""

from __future__ import annotations

import gzip
import io
import logging
import re
import tarfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from gbray.hub.adapters import PIECE, Refused, check_tgz

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClientSettings:
    url: str
    token: str
    device: str = "device"
    timeout: float = 30.0
    must_first_pause: float = 5.0  # end and adapter: 5 s doubling to 60 s, for up to 15 minutes
    must_max_pause: float = 60.0
    must_for: float = 900.0
    piece_tries: int = 4  # each piece: 4 tries, pauses 4 s doubling to 30 s
    piece_first_pause: float = 4.0
    piece_max_pause: float = 30.0
    piece_size: int = PIECE
    stop_poll_every: float = 2.0
    ca: str | None = None  # a certificate authority (PEM) for an https:// hub; None: the system's


class Unverified(requests.RequestException):
    """The hub's certificate could not be verified: the client sends it nothing more (the token
    was never sent: TLS fails before a request is written)."""


def _retry(tries: int, first_pause: float, max_pause: float) -> Retry:
    # urllib3 sleeps backoff_factor * 2**(n-1) before the n-th consecutive retry after the first.
    return Retry(
        total=tries - 1,
        connect=tries - 1,
        read=tries - 1,
        status=tries - 1,
        other=tries - 1,
        backoff_factor=first_pause / 2,
        backoff_max=max_pause,
        allowed_methods=None,
        status_forcelist=(500, 502, 503, 504),
        raise_on_status=False,
    )


def pack_adapter(folder: Path) -> bytes:
    """An adapter folder as one tgz whose members are the folder's files, at the top (the field's
    client extracts it into a folder and loads that folder)."""
    buffer = io.BytesIO()
    # mtime 0 in the gzip header: the same folder always packs to the same bytes.
    with (
        gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w") as tar,
    ):
        for path in sorted(Path(folder).iterdir()):
            if path.is_file() and not path.is_symlink():
                tar.add(path, arcname=path.name)
    return buffer.getvalue()


def unpack_adapter(tgz: Path, into: Path) -> Path:
    """Extract an adapter tgz into `into` (the adapter folder), refusing links and escapes."""
    check_tgz(tgz)
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tgz, "r:gz") as tar:
        tar.extractall(into, filter="data")
    return into


def _ssl_reason(error: Exception) -> str:
    """The certificate's fault in a few words (requests nests it several exceptions deep)."""
    found = re.search(r"certificate verify failed: ([^(\"']+)", str(error))
    return found.group(1).strip() if found else str(error)[:200]


def _refused_for_good(error: requests.HTTPError) -> bool:
    """A 4xx other than a time-out or too-many-requests: sending it again cannot help."""
    status = error.response.status_code if error.response is not None else 0
    return 400 <= status < 500 and status not in (408, 429)


class HubClient:
    """One round's client of the hub, in the process that holds it."""

    actor = None  # a `Hub` held in the round's own process: nothing to report through

    def __init__(self, settings: ClientSettings):
        self.settings = settings
        self.base = settings.url.rstrip("/")
        self.round_id: str | None = None
        self.kept: deque = deque()
        self.lock = threading.Lock()
        self.stop = False
        self._last_poll = 0.0
        self.unverified: str | None = None  # why the hub could not be verified
        self.once = self._session(1, 0, 0)
        self.piece = self._session(
            settings.piece_tries, settings.piece_first_pause, settings.piece_max_pause
        )

    def _session(self, tries: int, first: float, most: float) -> requests.Session:
        session = requests.Session()
        session.headers["Authorization"] = f"Bearer {self.settings.token}"
        session.mount("http://", HTTPAdapter(max_retries=_retry(max(1, tries), first, most)))
        session.mount("https://", HTTPAdapter(max_retries=_retry(max(1, tries), first, most)))
        return session

    def _call(self, session, method: str, path: str, **kw) -> requests.Response:
        if self.unverified:
            raise Unverified(self.unverified)
        if self.settings.ca:
            # Per request: requests lets $REQUESTS_CA_BUNDLE override a session's `verify`.
            kw["verify"] = self.settings.ca
        try:
            response = session.request(
                method, self.base + path, timeout=self.settings.timeout, **kw
            )
        except requests.exceptions.SSLError as e:
            self.unverified = f"cannot verify the hub at {self.base}: {_ssl_reason(e)}"
            log.error("hub: %s; no token sent, the night runs without the hub", self.unverified)
            raise Unverified(self.unverified) from e
        response.raise_for_status()
        return response

    def _best_effort(self, what: str, session, method: str, path: str, **kw):
        try:
            return self._call(session, method, path, **kw)
        except Unverified:
            return None  # said once, when it was found
        except requests.RequestException as e:
            log.warning("hub: %s failed: %s", what, e)
            return None

    # -- work -----------------------------------------------------------------------------------

    def slice(self, turns: int) -> list[bytes] | None:
        r = self._best_effort(
            "slice",
            self.once,
            "GET",
            "/v1/training/slice",
            params={"turns": turns, "device": self.settings.device},
        )
        return [line for line in r.content.splitlines() if line.strip()] if r is not None else None

    def paper(self, turns: int) -> tuple[list[bytes], str, str] | None:
        r = self._best_effort(
            "evalslice",
            self.once,
            "GET",
            "/v1/training/evalslice",
            params={"turns": turns, "device": self.settings.device},
        )
        if r is None:
            return None
        lines = [line for line in r.content.splitlines() if line.strip()]
        return lines, r.headers.get("X-Exam-Paper", ""), r.headers.get("X-Exam-Scope", "")

    def register(self, base: str, turns: int, recipe: dict) -> str | None:
        r = self._best_effort(
            "register",
            self.once,
            "POST",
            "/v1/training/rounds",
            json={"device": self.settings.device, "base": base, "turns": turns, "recipe": recipe},
        )
        self.round_id = r.json()["id"] if r is not None else None
        return self.round_id

    # -- baselines ------------------------------------------------------------------------------

    def ask_baseline(self, key: dict) -> dict | None:
        r = self._best_effort(
            "baseline",
            self.once,
            "GET",
            "/v1/training/baseline",
            params={**key, "device": self.settings.device},
        )
        return r.json() if r is not None else None

    def tell_baseline(self, key: dict, exam: dict) -> None:
        """Tell a measured baseline: `exam` is an exam object (`agreement_pct`, `turns`, ...)."""
        self._best_effort(
            "tell baseline",
            self.once,
            "POST",
            "/v1/training/baseline",
            json={**key, "baseline": exam, "device": self.settings.device},
        )

    # -- progress -------------------------------------------------------------------------------

    def _send_kept(self) -> bool:
        """Send kept notes and checks in order; stop at the first that fails and keep it (the hub
        is down or restarting). One the hub refuses for good (a 4xx) is dropped, so it cannot hold
        up the lines after it. Holds the lock."""
        while self.kept:
            kind, body = self.kept[0]
            try:
                r = self._call(
                    self.once, "POST", f"/v1/training/rounds/{self.round_id}/{kind}", json=body
                )
            except requests.HTTPError as e:
                if not _refused_for_good(e):
                    return False
                log.warning("hub: %s refused, dropped: %s", kind, e.response.text[:200])
                self.kept.popleft()
                continue
            except requests.RequestException as e:
                log.debug("hub: %s kept (%d waiting): %s", kind, len(self.kept), e)
                return False
            self.kept.popleft()
            if r.json().get("stop"):
                self.stop = True
        return True

    def _progress(self, kind: str, body: dict) -> bool:
        if self.round_id is None:
            return self.stop
        with self.lock:
            self.kept.append((kind, body))
            self._send_kept()
        return self.stop

    def note(self, line: str) -> bool:
        """Send one progress line; returns whether the owner asked the round to stop."""
        return self._progress("note", {"line": line})

    def check(self, point: dict) -> bool:
        return self._progress("check", point)

    def stopped(self) -> bool:
        """Whether the owner asked this round to stop (asks the hub at most every few seconds)."""
        if self.stop or self.round_id is None:
            return self.stop
        now = time.monotonic()
        if now - self._last_poll >= self.settings.stop_poll_every:
            self._last_poll = now
            with self.lock:
                self._send_kept()
            r = self._best_effort(
                "stop poll", self.once, "GET", f"/v1/training/rounds/{self.round_id}"
            )
            if r is not None and r.json().get("stop"):
                self.stop = True
        return self.stop

    # -- the end and adapters -------------------------------------------------------------------

    def _must(self, what: str, send) -> bool:
        """Retry `send()` with growing pauses for up to the must-land window."""
        deadline = time.monotonic() + self.settings.must_for
        pause = self.settings.must_first_pause
        while True:
            try:
                send()
                return True
            except (requests.RequestException, Refused) as e:
                if isinstance(e, Unverified):
                    return False
                if isinstance(e, requests.HTTPError) and _refused_for_good(e):
                    log.error(
                        "hub: %s refused: %s %s",
                        what,
                        e.response.status_code,
                        e.response.text[:300],
                    )
                    return False
                if time.monotonic() + pause > deadline:
                    log.error("hub: %s did not land: %s", what, e)
                    return False
                log.warning("hub: %s failed (%s); again in %.0f s", what, e, pause)
                time.sleep(pause)
                pause = min(pause * 2, self.settings.must_max_pause)

    def end(self, body: dict) -> bool:
        if self.round_id is None:
            return False
        with self.lock:
            self._send_kept()
        return self._must(
            "end",
            lambda: self._call(
                self.once, "POST", f"/v1/training/rounds/{self.round_id}/end", json=body
            ),
        )

    def put_adapter(self, folder: Path, part: str | None = None) -> str | None:
        """Upload an adapter folder; returns its name on the hub, or None if it did not land."""
        if self.round_id is None:
            return None
        body = pack_adapter(Path(folder))
        path = f"/v1/training/rounds/{self.round_id}/adapter"
        params = {"part": part} if part else {}
        size = self.settings.piece_size
        if len(body) <= size:
            ok = self._must(
                "adapter", lambda: self._call(self.once, "PUT", path, params=params, data=body)
            )
        else:
            pieces = [body[i : i + size] for i in range(0, len(body), size)]

            def send_pieces():
                for i, piece in enumerate(pieces):
                    self._call(
                        self.piece,
                        "PUT",
                        path,
                        params={**params, "chunk": i, "of": len(pieces)},
                        data=piece,
                    )

            ok = self._must(f"adapter in {len(pieces)} pieces", send_pieces)
        return self.round_id + ("-last" if part else "") if ok else None

    def serving(self) -> dict | None:
        """What serves now (its round, adapter, since, and that round's scores), or None if
        nothing does; raises when the hub cannot say (a round cannot start from it unknown)."""
        return self._call(self.piece, "GET", "/v1/training/serving").json()["serving"]

    def get_adapter(self, name: str, into: Path) -> Path:
        """Fetch `<id>` or `<id>-last` and extract it; raises (the round cannot start without it)."""
        r = self._call(self.piece, "GET", f"/v1/training/adapters/{name}")
        into.mkdir(parents=True, exist_ok=True)
        tgz = into / f"{name}.tgz"
        tgz.write_bytes(r.content)
        return unpack_adapter(tgz, into / name)


class Hub(Protocol):
    """What a round asks of a hub. Three kinds: `RayHub` (the round's hub client in a Ray actor),
    `HubClient` itself (a round run in one process) and `NoHub` (no hub: nothing known, nothing
    stopped, nothing sent). The round never asks which one it holds."""

    #: the Ray actor that trainers and examiners report through (None: they report nowhere)
    actor: Any

    def register(self, base: str, turns: int, recipe: dict) -> str | None: ...
    def note(self, line: str) -> None: ...
    def check(self, point: dict) -> bool: ...
    def stopped(self) -> bool: ...
    def slice(self, turns: int) -> list[bytes] | None: ...
    def paper(self, turns: int) -> tuple[list[bytes], str, str] | None: ...
    def ask_baseline(self, key: dict) -> dict | None: ...
    def tell_baseline(self, key: dict, exam: dict) -> None: ...
    def serving(self) -> dict | None: ...
    def get_adapter(self, name: str, into: Path) -> Path: ...
    def put_adapter(self, folder: Path, part: str | None = None) -> str | None: ...
    def end(self, body: dict) -> bool: ...


class NoHub:
    """The hub a round without one holds: it knows nothing and asks for nothing."""

    actor = None

    def register(self, base: str, turns: int, recipe: dict) -> str | None:
        return None

    def note(self, line: str) -> None:
        return None

    def check(self, point: dict) -> bool:
        return False

    def stopped(self) -> bool:
        return False

    def slice(self, turns: int) -> list[bytes] | None:
        return None

    def paper(self, turns: int) -> tuple[list[bytes], str, str] | None:
        return None

    def ask_baseline(self, key: dict) -> dict | None:
        return None

    def tell_baseline(self, key: dict, exam: dict) -> None:
        return None

    def serving(self) -> dict | None:
        raise ValueError("hub:serving needs --hub")

    def get_adapter(self, name: str, into: Path) -> Path:
        raise ValueError(f"hub:{name} needs --hub")

    def put_adapter(self, folder: Path, part: str | None = None) -> str | None:
        return None

    def end(self, body: dict) -> bool:
        return False
