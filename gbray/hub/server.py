"""The hub's HTTP face (SPEC §8): the paths devices already speak, bearer-token auth, a status page.

Never imports torch. Endpoints are plain `def`s: FastAPI runs them in its thread pool, and the
store opens a connection per call.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import (
    FileResponse,
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
)
from pydantic import BaseModel, ConfigDict

from gbray.hub.adapters import AdapterStore, Refused
from gbray.hub.store import Conflict, NotFound, Store

log = logging.getLogger(__name__)
PAGE = Path(__file__).parent / "page" / "index.html"
SCRIPT = Path(__file__).parent / "page" / "page.js"
# The page's script comes from the hub itself, never inline: device text that slipped into markup
# would be blocked, not run.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self' "
    "'unsafe-inline'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@dataclass(frozen=True)
class HubSettings:
    db: Path
    store: Path
    host: str = "127.0.0.1"
    port: int = 8600
    claim_timeout: float = 600.0  # seconds a baseline claim survives its device's silence
    size_limit: int = 512 * 1024 * 1024


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class RegisterBody(Body):
    device: str = "unknown"
    base: str = ""
    turns: int = 0
    recipe: dict = {}


class NoteBody(Body):
    line: str


class CheckBody(Body):
    step: int | None = None
    turns: int | None = None
    valLoss: float | None = None
    trainLoss: float | None = None
    best: bool | None = None  # whether this point is the best so far
    lr: float | None = None


class ExamBody(Body):
    """An exam result as the field sends it: `agreement_pct` and `turns`, more fields allowed."""

    agreement_pct: float
    turns: int | None = None


class EndBody(Body):
    status: Literal["done", "failed", "stopped"] = "done"
    baseline: ExamBody | None = None
    result: ExamBody | None = None
    adapter: str | None = None
    paper: str | None = None
    why: str | None = None
    trained: int | None = 0
    drawSeed: int | None = None


class BaselineBody(Body):
    scope: str
    base: str
    paper: str
    turns: int
    answer: int
    student: str
    baseline: ExamBody


def create_app(settings: HubSettings) -> FastAPI:
    store = Store(settings.db, claim_timeout=settings.claim_timeout)
    adapters = AdapterStore(settings.store, size_limit=settings.size_limit)
    app = FastAPI(
        title="gbray hub",
        description="Hands out slices and papers, caches baselines, keeps rounds, "
        "their curves and adapters, and promotes only rounds that beat their own baseline.",
    )
    app.state.store, app.state.adapters = store, adapters

    def caller(request: Request) -> tuple[str, bool]:
        auth = request.headers.get("authorization", "")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        who = store.who(token) if token else None
        if who is None:
            raise HTTPException(
                401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
            )
        return who

    def owner(who=Depends(caller)) -> tuple[str, bool]:
        if not who[1]:
            raise HTTPException(403, "this needs an owner token")
        return who

    def stop_answer(stop: bool) -> dict:
        return {"stop": True} if stop else {}

    @app.exception_handler(NotFound)
    def not_found(_request, exc):
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(Conflict)
    def conflict(_request, exc):
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(Refused)
    def refused(_request, exc):
        return JSONResponse({"detail": str(exc)}, status_code=exc.status)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def page():
        return HTMLResponse(PAGE.read_text(), headers=PAGE_HEADERS)

    @app.get("/page.js", include_in_schema=False)
    def page_script():
        return Response(SCRIPT.read_text(), media_type="text/javascript", headers=PAGE_HEADERS)

    @app.post("/v1/training/rounds")
    def register(body: RegisterBody, who=Depends(caller)):
        return {"id": store.register(body.device or who[0], body.base, body.turns, body.recipe)}

    @app.post("/v1/training/rounds/{round_id}/note")
    def note(round_id: str, body: NoteBody, _who=Depends(caller)):
        return stop_answer(store.note(round_id, body.line))

    @app.post("/v1/training/rounds/{round_id}/check")
    def check(round_id: str, body: CheckBody, _who=Depends(caller)):
        return stop_answer(store.check(round_id, body.model_dump()))

    @app.get("/v1/training/rounds/{round_id}")
    def round_detail(round_id: str, _who=Depends(caller)):
        """The round with its notes and curve; asking also tells the round whether to stop."""
        return {**store.round(round_id), **stop_answer(store.stopping(round_id))}

    @app.post("/v1/training/rounds/{round_id}/end")
    def end(round_id: str, body: EndBody, _who=Depends(caller)):
        store.end(round_id, body.model_dump())
        return {}

    @app.get("/v1/training/slice", response_class=PlainTextResponse)
    def slice_(
        turns: int = Query(..., ge=1, le=1_000_000), device: str = "unknown", _who=Depends(caller)
    ):
        lines = store.take_slice(turns, device, seed=random.randrange(2**31))
        return PlainTextResponse(
            "\n".join(lines) + ("\n" if lines else ""), media_type="application/jsonl"
        )

    @app.get("/v1/training/evalslice", response_class=PlainTextResponse)
    def evalslice(
        turns: int = Query(..., ge=1, le=100_000), device: str = "unknown", _who=Depends(caller)
    ):
        lines, paper, scope = store.paper(turns)
        return PlainTextResponse(
            "\n".join(lines) + ("\n" if lines else ""),
            media_type="application/jsonl",
            headers={"X-Exam-Paper": paper, "X-Exam-Scope": scope},
        )

    @app.get("/v1/training/baseline")
    def ask_baseline(
        scope: str,
        base: str,
        paper: str,
        turns: int,
        answer: int,
        student: str,
        device: str = "unknown",
        _who=Depends(caller),
    ):
        return store.ask_baseline((scope, base, paper, turns, answer, student), device)

    @app.post("/v1/training/baseline")
    def tell_baseline(body: BaselineBody, who=Depends(caller)):
        key = (body.scope, body.base, body.paper, body.turns, body.answer, body.student)
        store.tell_baseline(
            key, body.baseline.model_dump(), getattr(body, "device", None) or who[0]
        )
        return {}

    @app.put("/v1/training/rounds/{round_id}/adapter")
    async def put_adapter(
        round_id: str,
        request: Request,
        part: str | None = None,
        chunk: int | None = None,
        of: int | None = None,
        _who=Depends(caller),
    ):
        store.round(round_id)  # 404 for an unknown round, before reading a byte
        if part not in (None, "last"):
            raise Refused(400, "part must be 'last' or absent")
        name = round_id + ("-last" if part == "last" else "")
        if (chunk is None) != (of is None):
            raise Refused(400, "chunk and of go together")
        if chunk is None:
            body = []
            size = 0
            async for piece in request.stream():
                size += len(piece)
                if size > adapters.size_limit:
                    raise Refused(
                        413, f"adapter body over the limit of {adapters.size_limit} bytes"
                    )
                body.append(piece)
            return {"name": name, "size": adapters.put_whole(name, body)}
        body = await _read_limited(request, adapters.piece)
        return {"name": name, **adapters.put_piece(name, chunk, of, body)}

    @app.get("/v1/training/adapters/{name}")
    def get_adapter(name: str, _who=Depends(caller)):
        if not adapters.exists(name):
            raise NotFound(f"no adapter {name}")
        return FileResponse(
            adapters.path(name), media_type="application/gzip", filename=f"{name}.tgz"
        )

    @app.get("/v1/training/state")
    def state(_who=Depends(caller)):
        return store.state()

    @app.post("/v1/training/rounds/{round_id}/stop")
    def stop(round_id: str, _who=Depends(owner)):
        store.request_stop(round_id)
        return {"stopping": round_id}

    @app.post("/v1/training/rounds/{round_id}/promote")
    def promote(round_id: str, _who=Depends(owner)):
        return {"serving": store.promote(round_id, round_id, adapters.exists(round_id))}

    @app.get("/v1/training/serving")
    def serving(_who=Depends(caller)):
        return {"serving": store.serving()}

    @app.get("/v1/whoami", include_in_schema=False)
    def whoami(who=Depends(caller)):
        return {"name": who[0], "owner": who[1]}

    return app


async def _read_limited(request: Request, limit: int) -> bytes:
    data = bytearray()
    async for piece in request.stream():
        data.extend(piece)
        if len(data) > limit:
            raise Refused(400, f"a piece holds at most {limit} bytes")
    return bytes(data)


def serve(settings: HubSettings) -> None:
    import uvicorn

    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info")


class EmbeddedHub:
    """A hub served from a thread of this process (the demo's): uvicorn on a loopback port."""

    def __init__(self, settings: HubSettings):
        import uvicorn

        self.settings = settings
        self.url = f"http://{settings.host}:{settings.port}"
        config = uvicorn.Config(
            create_app(settings), host=settings.host, port=settings.port, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = None

    def start(self) -> EmbeddedHub:
        import threading
        import time

        self.thread = threading.Thread(target=self.server.run, name="gbray-hub", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the embedded hub did not start on {self.url}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=10)


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
